"""Whole fetches over a real listener (no engine): copies, refusals, failures,
and connections kept open between fetches."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch
from disagg_connectors.socket_connector import client
from disagg_connectors.socket_connector.auth import server_handshake
from disagg_connectors.socket_connector.client import (
    FetchError,
    FetchOptions,
    FetchPlan,
    PeerConnections,
    fetch,
    release_only,
)
from disagg_connectors.socket_connector.layout import StagedStore, make_store
from disagg_connectors.socket_connector.leases import LeaseTable
from disagg_connectors.socket_connector.server import KVServer
from disagg_connectors.socket_connector.wire import recv_frame, send_frame
from disagg_connectors.socket_connector.wire import wait_readable as wire_readable

from harness.ports import free_port
from tests.unit.connectors.kvdata import NUM_BLOCKS, SECRET, eventually, kv_caches, reaped


@pytest.mark.parametrize("streams", [1, 3])
@pytest.mark.parametrize("per_msg", [1, 4, 64])
def test_fetch_copies_exactly_the_leased_blocks(served, streams: int, per_msg: int) -> None:
    server, src = served
    remote = [5, 6, 7, 20, 21, 2, 30]
    local = [0, 1, 2, 10, 11, 12, 31]
    server.leases.register("req-1", remote, 30)
    dst = kv_caches(0, fill=False)
    store = make_store(dst, NUM_BLOCKS)
    result = fetch(FetchPlan("127.0.0.1", server.port, "req-1", remote, local), SECRET, store,
                   FetchOptions(streams=streams, blocks_per_message=per_msg, io_timeout_s=5))
    assert result.nbytes == len(remote) * store.layout.block_bytes
    assert result.streams == min(streams, len(remote))
    for name in src:
        for r, loc in zip(remote, local, strict=True):
            assert torch.equal(dst[name][loc], src[name][r]), (name, r, loc)
        assert not dst[name][3].any()
    # Released: P reports it done, and a second fetch is refused.
    assert eventually(reaped(server.leases), ({"req-1"}, set())) == ({"req-1"}, set())
    with pytest.raises(FetchError, match="refused request req-1"):
        fetch(FetchPlan("127.0.0.1", server.port, "req-1", remote, local), SECRET, store, FetchOptions())


def test_fetch_with_a_wrong_secret_is_refused_and_counted(served) -> None:
    server, _ = served
    server.leases.register("req-1", [1], 30)
    store = make_store(kv_caches(0, fill=False), NUM_BLOCKS)
    with pytest.raises(FetchError, match="auth"):
        fetch(FetchPlan("127.0.0.1", server.port, "req-1", [1], [1]), b"x" * 32, store, FetchOptions())
    refused: list[float] = []
    assert eventually(lambda: refused.extend((server.counters.drain() or {}).get("num_refused", [])) or refused,
                      [1]) == [1]
    assert len(server.leases) == 1  # the lease is untouched


def test_fetch_of_blocks_outside_the_lease_is_refused(served) -> None:
    server, _ = served
    server.leases.register("req-1", [1, 2], 30)
    store = make_store(kv_caches(0, fill=False), NUM_BLOCKS)
    with pytest.raises(FetchError, match="not leased"):
        fetch(FetchPlan("127.0.0.1", server.port, "req-1", [1, 3], [1, 3]), SECRET, store, FetchOptions())


def test_unknown_request_is_refused(served) -> None:
    server, _ = served
    store = make_store(kv_caches(0, fill=False), NUM_BLOCKS)
    with pytest.raises(FetchError, match="unknown, released or expired request ghost"):
        fetch(FetchPlan("127.0.0.1", server.port, "ghost", [1], [1]), SECRET, store, FetchOptions())


def test_layout_mismatch_fails_before_any_data(served) -> None:
    server, _ = served
    server.leases.register("req-1", [1], 30)
    other = {"model.layers.0.self_attn.attn": torch.zeros(NUM_BLOCKS, 2, 16, 64, dtype=torch.bfloat16)}
    with pytest.raises(FetchError, match="layout"):
        fetch(FetchPlan("127.0.0.1", server.port, "req-1", [1], [1]), SECRET, make_store(other, NUM_BLOCKS),
              FetchOptions())


def test_release_only_frees_the_lease(served) -> None:
    server, _ = served
    server.leases.register("req-1", [1], 30)
    plan = FetchPlan("127.0.0.1", server.port, "req-1", [1], [])
    assert release_only(plan, SECRET, make_store(kv_caches(0, fill=False), NUM_BLOCKS), FetchOptions())
    assert eventually(reaped(server.leases), ({"req-1"}, set())) == ({"req-1"}, set())


def test_connection_refused_is_a_clean_error() -> None:
    port = free_port()
    store = make_store(kv_caches(0, fill=False), NUM_BLOCKS)
    with pytest.raises(FetchError, match=f"127.0.0.1:{port}") as info:
        fetch(FetchPlan("127.0.0.1", port, "r", [1], [1]), SECRET, store, FetchOptions(connect_timeout_s=1))
    assert not info.value.reached_peer


def test_a_frozen_peer_times_out() -> None:
    """A listener that accepts (kernel backlog) but never speaks, like a SIGSTOPped engine."""
    listener = socket.create_server(("127.0.0.1", 0))
    store = make_store(kv_caches(0, fill=False), NUM_BLOCKS)
    started = time.monotonic()
    with pytest.raises(FetchError, match="handshake"):
        fetch(FetchPlan("127.0.0.1", listener.getsockname()[1], "r", [1], [1]), SECRET, store,
              FetchOptions(io_timeout_s=0.5))
    assert time.monotonic() - started < 3
    listener.close()


def test_peer_dying_mid_transfer_fails_fast() -> None:
    """A stand-in prefill server (fault injection: no real engine can be cut mid-stream on cue)
    authenticates, announces the data, sends half of it and closes."""
    store = make_store(kv_caches(0, fill=False), NUM_BLOCKS)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def stand_in() -> None:
        for _ in range(2):  # the fetch, then the client's best-effort release
            conn, _ = listener.accept()
            with conn:
                server_handshake(conn, SECRET, f"127.0.0.1:{port}")
                send_frame(conn, {"ok": True, "layout": store.layout.fingerprint()})
                msg = recv_frame(conn)
                if msg["op"] != "fetch":
                    send_frame(conn, {"ok": False, "error": "gone"})
                    continue
                n = len(msg["block_ids"]) * store.layout.block_bytes
                send_frame(conn, {"ok": True, "nbytes": n})
                conn.sendall(b"\0" * (n // 2))

    t = threading.Thread(target=stand_in, daemon=True)
    t.start()
    started = time.monotonic()
    plan = FetchPlan("127.0.0.1", port, "r", [1, 2, 3], [1, 2, 3])
    with pytest.raises(FetchError, match="partial transfer") as info:
        fetch(plan, SECRET, store, FetchOptions(streams=1, io_timeout_s=5))
    assert time.monotonic() - started < 3
    assert info.value.reached_peer
    assert not release_only(plan, SECRET, store, FetchOptions())  # the stand-in answers "gone"
    t.join(5)
    listener.close()


def test_listener_binds_only_the_given_address() -> None:
    server = KVServer(make_store(kv_caches(0), NUM_BLOCKS), LeaseTable(), SECRET, "127.0.0.1", 0)
    server.start()
    try:
        assert server._sock is not None and server._sock.getsockname()[0] == "127.0.0.1"
    finally:
        server.close()
    busy = socket.create_server(("127.0.0.1", 0))
    with pytest.raises(OSError, match=r"cannot listen on 127\.0\.0\.1:"):
        KVServer(make_store(kv_caches(0), NUM_BLOCKS), LeaseTable(), SECRET, "127.0.0.1",
                 busy.getsockname()[1]).start()
    busy.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (absent hardware)")
def test_fetch_between_cuda_caches_through_pinned_buffers(served) -> None:
    """The accelerator path end to end: CPU source served, CUDA destination filled via pinned staging."""
    server, src = served
    server.leases.register("req-1", [3, 4, 5], 30)
    dst = {k: torch.zeros_like(v, device="cuda") for k, v in src.items()}
    store = make_store(dst, NUM_BLOCKS)
    assert isinstance(store, StagedStore)
    fetch(FetchPlan("127.0.0.1", server.port, "req-1", [3, 4, 5], [0, 1, 2]), SECRET, store,
          FetchOptions(streams=2, blocks_per_message=2))
    for name in src:
        assert torch.equal(dst[name][:3].cpu(), src[name][3:6])


def test_fetch_from_another_engine_on_the_same_port_is_refused(served) -> None:
    server, _ = served
    server.engine_id = "engine-now"
    server.leases.register("req-1", [1], 30)
    store = make_store(kv_caches(0, fill=False), NUM_BLOCKS)
    with pytest.raises(FetchError, match="not 'engine-before'"):
        fetch(FetchPlan("127.0.0.1", server.port, "req-1", [1], [1], engine_id="engine-before"), SECRET, store,
              FetchOptions())


def test_fetch_of_nothing_just_releases(served) -> None:
    server, _ = served
    server.leases.register("req-1", [1], 30)
    res = fetch(FetchPlan("127.0.0.1", server.port, "req-1", [], []), SECRET,
                make_store(kv_caches(0, fill=False), NUM_BLOCKS), FetchOptions())
    assert res.nbytes == 0
    assert eventually(reaped(server.leases), ({"req-1"}, set())) == ({"req-1"}, set())


def test_a_stalled_peer_times_out_mid_transfer() -> None:
    """A stand-in prefill server (fault injection) sends half the data, then goes silent."""
    store = make_store(kv_caches(0, fill=False), NUM_BLOCKS)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    done = threading.Event()

    def stand_in() -> None:
        conn, _ = listener.accept()
        with conn:
            server_handshake(conn, SECRET, f"127.0.0.1:{port}")
            send_frame(conn, {"ok": True, "layout": store.layout.fingerprint()})
            msg = recv_frame(conn)
            n = len(msg["block_ids"]) * store.layout.block_bytes
            send_frame(conn, {"ok": True, "nbytes": n})
            conn.sendall(b"\0" * (n // 2))
            done.wait(10)

    threading.Thread(target=stand_in, daemon=True).start()
    started = time.monotonic()
    with pytest.raises(FetchError, match="timed out after"):
        fetch(FetchPlan("127.0.0.1", port, "r", [1, 2, 3], [1, 2, 3]), SECRET, store,
              FetchOptions(streams=1, io_timeout_s=0.5))
    assert time.monotonic() - started < 3  # one or two io timeouts, not the stand-in's 10 s
    done.set()
    listener.close()


# -- connections kept open between fetches -------------------------------------

@pytest.fixture
def connects(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Every authenticated connection the client opens, in order."""
    opened: list[tuple[str, int]] = []
    real = client.connect

    def counting(host: str, port: int, *args, **kwargs):
        opened.append((host, port))
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(client, "connect", counting)
    return opened


def fetch_and_check(conns: PeerConnections, server: KVServer, src: dict[str, torch.Tensor],
                    dst: dict[str, torch.Tensor], rid: str, remote: list[int], local: list[int],
                    engine_id: str | None = None) -> None:
    """Lease ``remote`` on the server, fetch it into ``local``, compare, release."""
    server.leases.register(rid, remote, 30)
    plan = FetchPlan("127.0.0.1", server.port, rid, remote, local, engine_id)
    assert conns.fetch(plan).nbytes == len(remote) * conns._store.layout.block_bytes
    for name in src:
        for r, loc in zip(remote, local, strict=True):
            assert torch.equal(dst[name][loc], src[name][r]), (rid, name, r, loc)
    assert conns.release(plan)


def test_connections_are_kept_between_fetches(served, connects) -> None:
    server, src = served
    dst = kv_caches(0, fill=False)
    with PeerConnections(SECRET, make_store(dst, NUM_BLOCKS), FetchOptions(streams=2)) as conns:
        fetch_and_check(conns, server, src, dst, "r0", [1, 2, 3], [4, 5, 6])
        fetch_and_check(conns, server, src, dst, "r1", [7, 8], [9, 10])
        fetch_and_check(conns, server, src, dst, "r2", [11, 12, 13, 14], [15, 16, 17, 18])
        assert len(connects) == 2  # one per stream, for the first fetch only
        assert conns.idle_count() == 2
    assert conns.idle_count() == 0
    assert eventually(reaped(server.leases), ({"r0", "r1", "r2"}, set())) == ({"r0", "r1", "r2"}, set())


def server_dropped_idle(conns: PeerConnections, timeout_s: float = 5.0) -> bool:
    """Wait until the server closed every pooled connection (EOF readable on each), instead of
    sleeping a fixed time that a loaded machine may overrun; False after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while any(not wire_readable(c.sock, 0) for cs in conns._idle.values() for c in cs):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_connections_the_prefill_side_dropped_are_replaced(connects, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server closes connections idle for ``idle_timeout_s``; the next fetch opens new ones,
    also when the drop is only noticed on the first message (the race: checked just before).

    A fetch of two blocks over two streams opens one or two connections: its second part's
    thread may start only after the first part returned its connection to the pool, and then
    takes that one. So each fetch after a drop must open at least one (every pooled one is
    dead) and at most two."""
    src = kv_caches(7)
    server = KVServer(make_store(src, NUM_BLOCKS), LeaseTable(), SECRET, "127.0.0.1", 0, idle_timeout_s=0.2)
    server.start()
    dst = kv_caches(0, fill=False)
    try:
        with PeerConnections(SECRET, make_store(dst, NUM_BLOCKS), FetchOptions(streams=2)) as conns:
            fetch_and_check(conns, server, src, dst, "r0", [1, 2], [3, 4])
            assert 1 <= len(connects) <= 2
            for rid, remote, local in (("r1", [5, 6], [7, 8]), ("r2", [9, 10], [11, 12])):
                if rid == "r2":   # the drop now noticed only when the first message fails
                    monkeypatch.setattr(client, "wait_readable", lambda sock, seconds: False)
                assert server_dropped_idle(conns)
                before = len(connects)
                fetch_and_check(conns, server, src, dst, rid, remote, local)
                assert 1 <= len(connects) - before <= 2, (rid, connects)
    finally:
        server.close()


def test_a_restarted_prefill_engine_is_not_served_by_old_connections(served, connects) -> None:
    server, src = served
    dst = kv_caches(0, fill=False)
    server.engine_id = "engine-before"
    with PeerConnections(SECRET, make_store(dst, NUM_BLOCKS), FetchOptions(streams=1)) as conns:
        fetch_and_check(conns, server, src, dst, "r0", [1], [2], engine_id="engine-before")
        server.engine_id = "engine-now"
        fetch_and_check(conns, server, src, dst, "r1", [3], [4], engine_id="engine-now")
        assert len(connects) == 2  # the pooled connection belonged to the engine before
        server.leases.register("r2", [5], 30)
        with pytest.raises(FetchError, match="not 'engine-before'"):
            conns.fetch(FetchPlan("127.0.0.1", server.port, "r2", [5], [6], "engine-before"))
