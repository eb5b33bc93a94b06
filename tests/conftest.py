"""Every test session keeps its own list of live runs (``disagg.launch.live``): a state file a
test writes is never listed by ``disagg status`` outside it. Set before any test runs, so the
``disagg`` processes tests start inherit it. Under pytest-xdist (``-n``), tests/net runs on one
worker (``tests/xdist_schedule.py``)."""

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


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """``-n N`` (``--dist load``, the default): each test anywhere, but tests/net on one worker."""
    if config.getvalue("dist") != "load":
        return None
    from tests.xdist_schedule import NetTogether

    return NetTogether(config, log)
