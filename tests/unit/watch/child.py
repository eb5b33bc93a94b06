"""A ``disagg`` command run as a child process and ended with SIGTERM, as a terminal or a
service manager ends ``disagg logs -f`` and ``disagg top`` (tests/unit/watch/test_logs.py and
test_top.py): :func:`disagg_child` starts it and kills whatever is left after the test;
:func:`sigterm_and_wait` ends it and checks it exited cleanly."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

#: how long a SIGTERMed watcher may take to exit (it exits at once; the margin is a loaded machine's)
EXIT_WAIT_S = 20.0


@contextmanager
def disagg_child(*args: str) -> Iterator[subprocess.Popen[str]]:
    """``python -m disagg ARGS`` with its stdout and stderr piped (text); SIGKILLed and reaped
    on the way out if it still runs."""
    child = subprocess.Popen([sys.executable, "-m", "disagg", *args], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        yield child
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def sigterm_and_wait(child: subprocess.Popen[str]) -> str:
    """SIGTERM ``child``, wait for it to exit (at most :data:`EXIT_WAIT_S`), assert it exited with
    status 0 and without a traceback; its stderr."""
    child.send_signal(signal.SIGTERM)
    _, err = child.communicate(timeout=EXIT_WAIT_S)
    assert child.returncode == 0, err
    assert "Traceback" not in err, err
    return err
