"""The socket connector's transport without engines: auth, framing, partial
transfers, parallel streams, leases and layouts, over loopback."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch
from disagg_connectors.socket_connector.auth import AuthError, client_handshake, server_handshake
from disagg_connectors.socket_connector.layout import (
    DirectStore,
    LayoutError,
    StagedStore,
    as_block_bytes,
    describe,
    make_store,
)
from disagg_connectors.socket_connector.leases import LeaseTable
from disagg_connectors.socket_connector.wire import (
    MAX_IOVECS,
    PeerClosed,
    WireError,
    coalesce,
    recv_frame,
    recv_into_views,
    send_frame,
    send_views,
)

from tests.unit.connectors.kvdata import NUM_BLOCKS, SECRET, kv_caches

LISTENER = "127.0.0.1:5601"


@pytest.fixture
def pair_of_sockets():
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    yield a, b
    a.close()
    b.close()


# -- authentication -----------------------------------------------------------

def _handshake(server_secret: bytes, client_secret: bytes) -> tuple[BaseException | None, BaseException | None]:
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    errs: list[BaseException | None] = [None, None]

    def srv() -> None:
        try:
            server_handshake(a, server_secret, LISTENER)
        except BaseException as exc:
            errs[0] = exc
        finally:
            a.close()

    t = threading.Thread(target=srv)
    t.start()
    try:
        client_handshake(b, client_secret, LISTENER)
    except BaseException as exc:
        errs[1] = exc
    t.join()
    b.close()
    return errs[0], errs[1]


def test_auth_succeeds_with_the_shared_secret() -> None:
    assert _handshake(SECRET, SECRET) == (None, None)


def test_auth_refuses_a_wrong_secret_on_both_sides() -> None:
    srv, cli = _handshake(SECRET, b"another-secret-of-32-bytes-000000")
    assert isinstance(srv, AuthError)
    assert isinstance(cli, AuthError) and "auth failed" in str(cli)


def test_secret_never_crosses_the_wire() -> None:
    a, b = socket.socketpair()
    seen = bytearray()
    # Relay the client side through a tap that records every byte.
    c, d = socket.socketpair()

    def relay(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                seen.extend(data)
                dst.sendall(data)
        except OSError:
            pass  # the test closed the sockets

    threads = [threading.Thread(target=relay, args=(b, c)), threading.Thread(target=relay, args=(c, b))]
    for t in threads:
        t.daemon = True
        t.start()
    srv = threading.Thread(target=server_handshake, args=(a, SECRET, LISTENER))
    srv.start()
    client_handshake(d, SECRET, LISTENER)
    srv.join()
    assert SECRET not in bytes(seen) and SECRET.hex().encode() not in bytes(seen)
    assert len(seen) > 64
    for s in (a, d, b, c):
        s.shutdown(socket.SHUT_RDWR)
        s.close()
    for t in threads:
        t.join(5)


def test_client_rejects_a_peer_speaking_another_protocol(pair_of_sockets) -> None:
    a, b = pair_of_sockets
    a.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n" + b"x" * 40)
    with pytest.raises(AuthError, match="not a socket KV connector"):
        client_handshake(b, SECRET, LISTENER)


# -- framing ------------------------------------------------------------------

def test_frames_round_trip(pair_of_sockets) -> None:
    a, b = pair_of_sockets
    send_frame(a, {"op": "fetch", "block_ids": list(range(1000))})
    assert recv_frame(b) == {"op": "fetch", "block_ids": list(range(1000))}


def test_oversized_and_malformed_frames_are_refused(pair_of_sockets) -> None:
    a, b = pair_of_sockets
    a.sendall((1 << 30).to_bytes(4, "big"))
    with pytest.raises(WireError, match="control frame"):
        recv_frame(b)
    a.sendall((3).to_bytes(4, "big") + b"[1]")
    with pytest.raises(WireError, match="not a JSON object"):
        recv_frame(b)


def test_send_views_handles_partial_writes_and_many_iovecs() -> None:
    """More views than IOV_MAX and more bytes than the socket buffer: all arrive in order."""
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    payload = bytes(range(256)) * 40 * (MAX_IOVECS * 3)
    step = 40 * 256 // 4
    views = [memoryview(payload)[i : i + step] for i in range(0, len(payload), step)]
    assert len(views) > MAX_IOVECS
    out = bytearray(len(payload))
    reader = threading.Thread(target=recv_into_views, args=(b, [memoryview(out)]))
    reader.start()
    assert send_views(a, views) == len(payload)
    reader.join(10)
    assert bytes(out) == payload
    a.close()
    b.close()


def test_recv_reports_a_partial_transfer(pair_of_sockets) -> None:
    a, b = pair_of_sockets
    a.sendall(b"x" * 100)
    a.close()
    with pytest.raises(WireError, match="after 100 bytes"):
        recv_into_views(b, [memoryview(bytearray(1000))])


def test_close_between_messages_is_clean(pair_of_sockets) -> None:
    a, b = pair_of_sockets
    a.close()
    with pytest.raises(PeerClosed):
        recv_frame(b)


def test_coalesce_merges_adjacent_extents_only() -> None:
    assert coalesce([(0, 10), (10, 5), (20, 5), (25, 5), (0, 1)]) == [(0, 15), (20, 10), (0, 1)]


# -- layouts ------------------------------------------------------------------

def test_cpu_layout_is_block_major() -> None:
    layout, views = describe(kv_caches(0), NUM_BLOCKS)
    assert [layer.outer for layer in layout.layers] == [1, 1]
    assert layout.block_bytes == 2 * (2 * 16 * 128 * 2)
    assert views[0].shape == (1, NUM_BLOCKS, 2 * 16 * 128 * 2)


def test_kv_first_layout_has_two_segments_per_block() -> None:
    """Flash-attention layout [2, num_blocks, block_size, heads, head]: K and V apart."""
    t = torch.arange(2 * NUM_BLOCKS * 16 * 2 * 8, dtype=torch.float16).view(2, NUM_BLOCKS, 16, 2, 8)
    v = as_block_bytes(t, NUM_BLOCKS)
    assert v.shape == (2, NUM_BLOCKS, 16 * 2 * 8 * 2)
    store = DirectStore(*describe({"l": t}, NUM_BLOCKS))
    with store.reading([3]) as views:
        got = b"".join(bytes(x) for x in views)
    assert got == t[0, 3].numpy().tobytes() + t[1, 3].numpy().tobytes()


def test_permuted_layout_follows_the_strides() -> None:
    """A stride order (HND-style permutation) is read in physical order."""
    base = torch.randn(NUM_BLOCKS, 4, 16, 8)  # physical: blocks, heads, tokens, dim
    logical = base.permute(0, 2, 1, 3)  # logical: blocks, tokens, heads, dim
    v = as_block_bytes(logical, NUM_BLOCKS)
    assert torch.equal(v[0, 5].view(torch.float32), base[5].reshape(-1))


def test_block_dim_ambiguity_prefers_the_outermost() -> None:
    t = torch.zeros(NUM_BLOCKS, 2, NUM_BLOCKS, 4)
    assert as_block_bytes(t, NUM_BLOCKS).shape == (1, NUM_BLOCKS, 2 * NUM_BLOCKS * 4 * 4)


def test_kernel_block_split_is_grouped() -> None:
    t = torch.zeros(NUM_BLOCKS * 2, 2, 8, 4)
    assert as_block_bytes(t, NUM_BLOCKS).shape == (1, NUM_BLOCKS, 2 * 2 * 8 * 4 * 4)


def test_layout_errors_name_the_problem() -> None:
    with pytest.raises(LayoutError, match="num_blocks=7"):
        as_block_bytes(torch.zeros(5, 3), 7)
    store = make_store(kv_caches(0), NUM_BLOCKS)
    with pytest.raises(LayoutError, match="out of range"), store.reading([NUM_BLOCKS]):
        pass


def test_staged_store_round_trips_through_host_buffers() -> None:
    """The accelerator path (gather -> host -> scatter), exercised on CPU tensors."""
    src_caches, dst_caches = kv_caches(1), kv_caches(2, fill=False)
    src = StagedStore(*describe(src_caches, NUM_BLOCKS), pin=False)
    dst = StagedStore(*describe(dst_caches, NUM_BLOCKS), pin=False)
    with src.reading([4, 9]) as views:
        data = [bytes(v) for v in views]
    with dst.writing([1, 2]) as views:
        for v, d in zip(views, data, strict=True):
            v[:] = d
    for name in src_caches:
        assert torch.equal(dst_caches[name][1], src_caches[name][4])
        assert torch.equal(dst_caches[name][2], src_caches[name][9])
        assert not dst_caches[name][3].any()


# -- leases -------------------------------------------------------------------

class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_lease_expires_unless_fetched_and_is_reported_once() -> None:
    clock = FakeClock()
    table = LeaseTable(clock)
    table.register("a", [1, 2], 30)
    table.register("b", [3], 30)
    lease = table.acquire("b", 0)
    assert lease is not None
    clock.now += 31
    assert table.reap() == (set(), {"a"})  # b has a fetch in flight: not expired under it
    table.end_fetch(lease, 10)
    assert table.reap() == (set(), {"b"})
    assert table.reap() == (set(), set())
    assert table.acquire("a", 0) is None


def test_release_ends_a_lease_after_its_fetches() -> None:
    table = LeaseTable()
    table.register("a", [1], 30)
    lease = table.acquire("a", 0)
    assert lease is not None
    assert table.release("a")
    assert table.reap() == (set(), set())  # fetch still running
    table.end_fetch(lease, 1)
    assert table.reap() == ({"a"}, set())
    assert not table.release("a")


def test_acquire_waits_for_a_late_registration() -> None:
    table = LeaseTable()
    threading.Timer(0.2, table.register, args=("late", [1], 30)).start()
    started = time.monotonic()
    assert table.acquire("late", 5) is not None
    assert time.monotonic() - started < 2
    assert table.acquire("never", 0.1) is None




def timed_reap(table: LeaseTable, wait_s: float) -> tuple[tuple[set[str], set[str]], float]:
    started = time.monotonic()
    result = table.reap(wait_s)
    return result, time.monotonic() - started


def test_reap_waits_only_while_leases_are_outstanding() -> None:
    table = LeaseTable()
    assert timed_reap(table, 5)[1] < 0.5  # nothing leased: nothing to wait for
    table.register("held", [1], 30)
    result, took = timed_reap(table, 0.1)
    assert result == (set(), set()) and 0.09 <= took < 1  # nothing ended: waited the whole time, no longer


def test_reap_returns_as_soon_as_a_lease_is_released_or_expires() -> None:
    table = LeaseTable()
    table.register("a", [1], 30)
    threading.Timer(0.1, table.release, args=("a",)).start()
    result, took = timed_reap(table, 5)
    assert result == ({"a"}, set()) and took < 2
    table.register("b", [2], 0.1)
    result, took = timed_reap(table, 5)
    assert result == (set(), {"b"}) and took < 2
