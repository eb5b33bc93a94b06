"""A plain progress bar on stderr (no dependency).

On a terminal it redraws one line; elsewhere (CI logs, files) it prints a line
at every 10% so logs stay short.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Counts finished requests of one run; ``update`` after each, ``close`` at the end."""

    WIDTH = 30

    def __init__(self, total: int, label: str, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.total = max(1, total)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.done = 0
        self.failed = 0
        self.start = time.monotonic()
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_decile = -1

    def line(self) -> str:
        """The current bar, e.g. ``rate 2/s [#####.....] 10/20 (1 failed) 3.2s``."""
        filled = self.WIDTH * self.done // self.total
        bar = "#" * filled + "." * (self.WIDTH - filled)
        failed = f" ({self.failed} failed)" if self.failed else ""
        return f"{self.label} [{bar}] {self.done}/{self.total}{failed} {time.monotonic() - self.start:.1f}s"

    def update(self, ok: bool = True) -> None:
        """One more request finished."""
        self.done += 1
        self.failed += 0 if ok else 1
        if not self.enabled:
            return
        if self._tty:
            self.stream.write("\r" + self.line())
            self.stream.flush()
            return
        decile = 10 * self.done // self.total
        if decile != self._last_decile:
            self._last_decile = decile
            self.stream.write(self.line() + "\n")
            self.stream.flush()

    def close(self) -> None:
        """Finish the line on a terminal."""
        if self.enabled and self._tty:
            self.stream.write("\n")
            self.stream.flush()
