"""harness.ports: the tests' server ports, below the ephemeral range; workers of a session split
by pytest-xdist take disjoint shares of it."""

from __future__ import annotations

import pytest

from harness import ports


@pytest.fixture(autouse=True)
def _no_binding(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every port counts as free: these tests bind nothing that another worker's share might hold."""
    monkeypatch.setattr(ports, "_bindable", lambda port, host: True)

def test_outside_xdist_the_whole_range_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    assert ports.worker_share() == (0, 1)
    low, _ = ports.ephemeral_range()
    got = ports.free_ports(50)
    assert len(set(got)) == 50 and all(ports.LOWEST <= p < low for p in got)


@pytest.mark.parametrize("worker", ["gw0", "gw1", "gw3"])
def test_each_xdist_worker_takes_its_own_share(monkeypatch: pytest.MonkeyPatch, worker: str) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "4")
    index = int(worker[2:])
    assert ports.worker_share() == (index, 4)
    low, _ = ports.ephemeral_range()
    got = ports.free_ports(50)
    assert len(set(got)) == 50 and all(p % 4 == index and ports.LOWEST <= p < low for p in got), got


@pytest.mark.parametrize(("worker", "count"), [("master", "4"), ("gw1", ""), ("gwx", "4"), ("gw1", "0")])
def test_anything_else_is_the_whole_range(monkeypatch: pytest.MonkeyPatch, worker: str, count: str) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", count)
    assert ports.worker_share() == (0, 1)
