"""Every test session keeps its own list of live runs (``disagg.launch.live``): a state file a
test writes is never listed by ``disagg status`` outside it. Set before any test runs, so the
``disagg`` processes tests start inherit it. Under pytest-xdist (``-n``), tests/net runs on one
worker (``tests/xdist_schedule.py``), and the long tests (marked ``engine`` or ``slow``) are
handed out first, so that none of them starts last and holds the run's end."""

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


#: markers of the tests that take tens of seconds each (pyproject.toml): handed out first under xdist
LONG_MARKERS = ("engine", "slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On an xdist worker, the long tests first (each worker collects, and the scheduler hands out
    the tests in that order): the longest first is what keeps the last worker from finishing
    alone. Elsewhere, the order stays as collected."""
    if not hasattr(config, "workerinput"):
        return
    long = [item for item in items if any(item.get_closest_marker(m) for m in LONG_MARKERS)]
    if long:
        chosen = set(map(id, long))
        items[:] = long + [item for item in items if id(item) not in chosen]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """``-n N`` (``--dist load``, the default): each test anywhere, but tests/net on one worker."""
    if config.getvalue("dist") != "load":
        return None
    from tests.xdist_schedule import NetTogether

    return NetTogether(config, log)
