"""The worker half without engines: a producer and a consumer worker in one
process, driven by the metadata the scheduler half would send."""

from __future__ import annotations

import dataclasses
import sys
import threading
import time

import pytest
import torch
from disagg_connectors.socket_connector.config import SocketSettings
from disagg_connectors.socket_connector.metadata import RecvSpec, SendSpec, SocketConnectorMetadata
from disagg_connectors.socket_connector.worker import SocketWorker

ENV = {"DISAGG_KV_SECRET": "w" * 64}
NUM_BLOCKS = 16


def caches(fill: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {f"layers.{i}": (torch.randn(NUM_BLOCKS, 2, 16, 64, generator=g) if fill
                            else torch.zeros(NUM_BLOCKS, 2, 16, 64)).to(torch.bfloat16) for i in range(2)}


@pytest.fixture(autouse=True)
def switch_interval():
    """Workers set the process's GIL switch interval: restore it after each test."""
    before = sys.getswitchinterval()
    yield before
    sys.setswitchinterval(before)


@pytest.fixture
def workers():
    p_settings = SocketSettings.load({"host": "127.0.0.1", "port": 0, "registration_wait_s": 0.2}, ENV,
                                     need_port=True)
    d_settings = SocketSettings.load({"io_timeout_s": 2}, ENV)
    p = SocketWorker(p_settings, "engine-p", True, 0, 1, NUM_BLOCKS)
    d = SocketWorker(d_settings, "engine-d", False, 0, 1, NUM_BLOCKS)
    p_caches, d_caches = caches(True), caches(False)
    p.register_kv_caches(p_caches)
    d.register_kv_caches(d_caches)
    yield p, d, p_caches, d_caches
    p.shutdown()
    d.shutdown()


def recv_spec(p: SocketWorker, remote_req: str, local: list[int], remote: list[int]) -> RecvSpec:
    assert p.server is not None
    return RecvSpec(local_block_ids=local, remote_block_ids=remote, remote_request_id=remote_req,
                    remote_host="127.0.0.1", remote_port=p.server.port, remote_tp_size=1, awaiting=True,
                    remote_engine_id="engine-p")


def collect(worker: SocketWorker, attr: str, want: str, timeout_s: float = 10.0) -> dict[str, set[str]]:
    """Poll get_transfer_results (as vLLM does every step) until ``want`` shows up in ``attr``."""
    seen: dict[str, set[str]] = {"finished_sending": set(), "finished_recving": set(), "failed_recving": set()}
    deadline = time.monotonic() + timeout_s
    while want not in seen[attr] and time.monotonic() < deadline:
        res = worker.get_transfer_results()
        for key in seen:
            seen[key] |= getattr(res, key)
        time.sleep(0.02)
    return seen


def test_fetch_reports_received_then_sent(workers) -> None:
    p, d, p_caches, d_caches = workers
    p.start_load_kv(SocketConnectorMetadata(reqs_to_send={"p1": SendSpec([2, 3], 30)}))
    d.start_load_kv(SocketConnectorMetadata(reqs_to_recv={"d1": recv_spec(p, "p1", [7, 8], [2, 3])}))
    assert collect(d, "finished_recving", "d1") == {
        "finished_sending": set(), "finished_recving": {"d1"}, "failed_recving": set()}
    for name in p_caches:
        assert torch.equal(d_caches[name][7:9], p_caches[name][2:4])
    assert collect(p, "finished_sending", "p1")["finished_sending"] == {"p1"}
    drained = d.counters.drain()
    assert drained is not None and drained["bytes_transferred"] == [2 * d.store.layout.block_bytes]


def test_failed_fetch_is_reported_finished_and_failed(workers) -> None:
    p, d, _, _ = workers
    d.start_load_kv(SocketConnectorMetadata(reqs_to_recv={"d2": recv_spec(p, "never-leased", [1], [1])}))
    seen = collect(d, "failed_recving", "d2")
    assert seen["failed_recving"] == seen["finished_recving"] == {"d2"}  # vLLM wants failures in both
    drained = d.counters.drain()
    assert drained is not None and drained["num_failed_transfers"] == [1]


def test_expired_lease_is_reported_sent_and_counted(workers) -> None:
    p, _, _, _ = workers
    p.start_load_kv(SocketConnectorMetadata(reqs_to_send={"p3": SendSpec([1], 0.2)}))
    assert collect(p, "finished_sending", "p3")["finished_sending"] == {"p3"}
    drained = p.counters.drain()
    assert drained is not None and drained["num_kv_expired_reqs"] == [1]


def test_tp_size_mismatch_fails_the_fetch(workers) -> None:
    p, d, _, _ = workers
    p.start_load_kv(SocketConnectorMetadata(reqs_to_send={"p4": SendSpec([1], 30)}))
    spec = recv_spec(p, "p4", [1], [1])
    spec.remote_tp_size = 2
    d.start_load_kv(SocketConnectorMetadata(reqs_to_recv={"d4": spec}))
    assert collect(d, "failed_recving", "d4")["failed_recving"] == {"d4"}


def test_a_crashed_fetch_is_reported_failed_and_still_frees_the_lease(workers, monkeypatch) -> None:
    p, d, _, _ = workers
    p.start_load_kv(SocketConnectorMetadata(reqs_to_send={"p6": SendSpec([1], 30)}))
    assert d._conns is not None

    def crash(plan):
        raise RuntimeError("bug in the fetch path")

    monkeypatch.setattr(d._conns, "fetch", crash)
    d.start_load_kv(SocketConnectorMetadata(reqs_to_recv={"d6": recv_spec(p, "p6", [1], [1])}))
    assert collect(d, "failed_recving", "d6")["failed_recving"] == {"d6"}
    # released by D long before the 30 s lease would expire, and counted as released, not expired
    assert collect(p, "finished_sending", "p6", timeout_s=5)["finished_sending"] == {"p6"}
    drained = p.counters.drain()
    assert drained is None or "num_kv_expired_reqs" not in drained


def test_idle_step_waits_for_the_transfer_instead_of_returning_at_once(workers) -> None:
    """The fetch is held behind a gate opened 0.3 s after the idle step began: the busy step cannot
    have seen it end (on a fast machine an ungated loopback fetch may end before that call), and the
    idle step can only report it by waiting for it."""
    p, d, _, _ = workers
    for worker in (p, d):  # long enough that one call must cover the whole fetch
        worker.settings = dataclasses.replace(worker.settings, idle_wait_ms=5000)
    started = time.monotonic()
    assert d.get_transfer_results(idle_step=True).finished_recving == set()  # nothing in flight: no wait
    assert p.get_transfer_results(idle_step=True).finished_sending == set()
    assert time.monotonic() - started < 1
    assert d._conns is not None
    gate, real_fetch = threading.Event(), d._conns.fetch

    def gated_fetch(plan):
        assert gate.wait(10), "the test never opened the gate"
        return real_fetch(plan)

    d._conns.fetch = gated_fetch  # type: ignore[method-assign]
    p.start_load_kv(SocketConnectorMetadata(reqs_to_send={"p5": SendSpec([2, 3], 30)}))
    d.start_load_kv(SocketConnectorMetadata(reqs_to_recv={"d5": recv_spec(p, "p5", [7, 8], [2, 3])}))
    busy_started = time.monotonic()
    assert d.get_transfer_results(idle_step=False).finished_recving == set()  # busy step: returns at once
    assert time.monotonic() - busy_started < 1
    opener = threading.Timer(0.3, gate.set)
    opener.start()
    idle_started = time.monotonic()
    assert d.get_transfer_results(idle_step=True).finished_recving == {"d5"}  # idle step: waited for it
    assert time.monotonic() - idle_started >= 0.25
    assert p.get_transfer_results(idle_step=True).finished_sending == {"p5"}
    assert time.monotonic() - started < 4
    opener.join()


@pytest.mark.parametrize(("configured_ms", "expected_s"), [(None, 0.0005), (2, 0.002), (0, 0.005)])
def test_worker_shortens_the_gil_switch_interval(configured_ms: float | None, expected_s: float) -> None:
    sys.setswitchinterval(0.005)
    extra = {} if configured_ms is None else {"gil_switch_interval_ms": configured_ms}
    d = SocketWorker(SocketSettings.load(extra, ENV), "engine-d", False, 0, 1, NUM_BLOCKS)
    d.register_kv_caches(caches(False))
    try:
        assert sys.getswitchinterval() == pytest.approx(expected_s)
    finally:
        d.shutdown()


def test_a_fetch_the_scheduler_could_not_start_is_reported_failed_without_contacting_anyone(
        workers, monkeypatch) -> None:
    _, d, _, _ = workers
    assert d._conns is not None
    contacted: list[object] = []
    monkeypatch.setattr(d._conns, "fetch", contacted.append)
    monkeypatch.setattr(d._conns, "release", contacted.append)
    spec = RecvSpec(local_block_ids=[], remote_block_ids=[], remote_request_id="", remote_host="", remote_port=0,
                    remote_tp_size=1, awaiting=True, failure="declined after the load was promised")
    d.start_load_kv(SocketConnectorMetadata(reqs_to_recv={"d7": spec}))
    seen = collect(d, "failed_recving", "d7")
    assert seen["failed_recving"] == seen["finished_recving"] == {"d7"}
    assert contacted == []
