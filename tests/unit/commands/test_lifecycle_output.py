"""`down` and the supervisor's own lines never stop a stop; the launcher's output reports a full disk.

`_tell` (down's lines, the detached supervisor's first) drops any write error; `_echo` (the
launcher's output) drops only a closed pipe and raises ENOSPC for the launcher's BestEffort to
report once (tests/unit/launch/test_supervisor.py injects that into a running supervisor).
"""

from __future__ import annotations

import errno
import io

import pytest

from disagg.commands import lifecycle


class Failing(io.StringIO):
    def __init__(self, exc: OSError) -> None:
        super().__init__()
        self.exc = exc

    def write(self, s: str) -> int:
        raise self.exc


def test_down_lines_never_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    for exc in (OSError(errno.ENOSPC, "No space left on device"), BrokenPipeError()):
        monkeypatch.setattr("sys.stdout", Failing(exc))
        lifecycle._tell("run: down")  # no exception


def test_the_launchers_output_raises_a_full_disk_and_drops_a_closed_pipe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stdout", Failing(BrokenPipeError()))
    lifecycle._echo("line")
    monkeypatch.setattr("sys.stdout", Failing(OSError(errno.ENOSPC, "No space left on device")))
    with pytest.raises(OSError) as caught:
        lifecycle._echo("line")
    assert caught.value.errno == errno.ENOSPC
