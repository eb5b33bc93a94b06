"""Every test session keeps its own list of live runs (``disagg.launch.live``): a state file a
test writes is never listed by ``disagg status`` outside it. Set before any test runs, so the
``disagg`` processes tests start inherit it."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session", autouse=True)
def _own_live_runs() -> Iterator[None]:
    previous = os.environ.get("XDG_STATE_HOME")
    with tempfile.TemporaryDirectory(prefix="disagg-test-state-") as state:
        os.environ["XDG_STATE_HOME"] = state
        try:
            yield
        finally:
            if previous is None:
                os.environ.pop("XDG_STATE_HOME", None)
            else:
                os.environ["XDG_STATE_HOME"] = previous
