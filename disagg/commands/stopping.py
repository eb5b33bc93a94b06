"""SIGTERM handled as Ctrl-C by the commands that must clean up after themselves.

Python's default SIGTERM ends the process at once, without ``finally`` blocks: a
``disagg bench compare`` killed that way would leave the deployment it brought up
running, a live ``disagg top`` would leave the terminal in its alternate screen.
:func:`sigterm_as_ctrl_c` raises KeyboardInterrupt on SIGTERM for the duration
of a ``with`` block, so the same clean-up runs as for Ctrl-C. Called by
:mod:`disagg.commands.bench` (``compare``) and :mod:`disagg.commands.watch`.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


@contextmanager
def sigterm_as_ctrl_c() -> Iterator[None]:
    """Within the block SIGTERM raises KeyboardInterrupt; the previous handler is restored after."""
    def stop(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
