"""Streamed transfers over a real listener (no engine): the prefill side's stream table is
driven step by step as an engine's forward would (bind_step, mark_layer, mark_step); the
decode side receives in a thread. What arrives, when, and every way a stream ends."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch
from disagg_connectors.socket_connector.client import FetchError, FetchOptions, FetchPlan, FetchResult, PeerConnections
from disagg_connectors.socket_connector.counters import TransferCounters
from disagg_connectors.socket_connector.layout import make_store
from disagg_connectors.socket_connector.leases import LeaseTable
from disagg_connectors.socket_connector.metadata import StreamStep
from disagg_connectors.socket_connector.server import KVServer
from disagg_connectors.socket_connector.streams import StreamClosed, StreamTable
from disagg_connectors.socket_connector.wire import recv_frame, send_frame

from tests.unit.connectors.kvdata import NUM_BLOCKS, SECRET, eventually, kv_caches, reaped

KEY = "k" * 32
BS = 16
P_BLOCKS = [9, 3, 17, 4, 30, 12]        # the prefill request's blocks (6 blocks: up to 96 tokens)
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


@dataclass
class Prefill:
    server: KVServer
    table: StreamTable
    leases: LeaseTable
    src: dict[str, torch.Tensor]

    def step(self, before: int, after: int, blocks: list[int] | None = None, key: str = KEY,
             rid: str = "p-req", num_tokens: int = 70) -> None:
        self.table.bind_step({key: StreamStep(rid, num_tokens, list(blocks or P_BLOCKS), before, after)}, {})


@dataclass
class Receiver:
    """A decode side receiving one stream in a thread."""

    plan: FetchPlan
    dst: dict[str, torch.Tensor]
    result: FetchResult | None = None
    error: BaseException | None = None
    sock: list[socket.socket | None] = field(default_factory=lambda: [None])
    thread: threading.Thread | None = None

    def blocks_equal(self, src: dict[str, torch.Tensor], layer: str, n: int) -> bool:
        return all(torch.equal(self.dst[layer][self.plan.local_block_ids[i]],
                               src[layer][P_BLOCKS[self.plan.first_block + i]]) for i in range(n))

    def untouched(self, layer: str, i: int) -> bool:
        return not self.dst[layer][self.plan.local_block_ids[i]].any()


@pytest.fixture
def prefill() -> Iterator[Prefill]:
    caches = kv_caches(7)
    store = make_store(caches, NUM_BLOCKS)
    table = StreamTable(BS, len(store.layout.layers))
    leases = LeaseTable()
    server = KVServer(store, leases, SECRET, "127.0.0.1", 0, io_timeout_s=3, counters=TransferCounters(),
                      streams=table, stream_wait_s=1.0)
    server.start()
    yield Prefill(server, table, leases, caches)
    server.close()


def receive(p: Prefill, num_tokens: int = 70, first: int = 0, local: list[int] | None = None,
            key: str = KEY, per_msg: int = 64, wire: str = "raw") -> Receiver:
    count = -(-num_tokens // BS) - first
    local = local if local is not None else list(range(20, 20 + count))
    plan = FetchPlan("127.0.0.1", p.server.port, key, list(range(first, first + count)), local,
                     stream_key=key, num_tokens=num_tokens, first_block=first)
    recv = Receiver(plan, kv_caches(0, fill=False))
    store = make_store(recv.dst, NUM_BLOCKS, wire)

    def run() -> None:
        conns = PeerConnections(SECRET, store, FetchOptions(blocks_per_message=per_msg, io_timeout_s=5))
        try:
            recv.result = conns.stream(plan, lambda s: recv.sock.__setitem__(0, s))
        except BaseException as exc:
            recv.error = exc
        finally:
            conns.close()

    recv.thread = threading.Thread(target=run, daemon=True)
    recv.thread.start()
    return recv


def finish(recv: Receiver, timeout: float = 5.0) -> Receiver:
    assert recv.thread is not None
    recv.thread.join(timeout)
    assert not recv.thread.is_alive(), "the stream did not end"
    return recv


def test_layers_arrive_as_the_forward_writes_them_and_only_whole_blocks(prefill: Prefill) -> None:
    recv = receive(prefill)                      # D connects before P scheduled the request
    time.sleep(0.1)
    prefill.step(0, 40)                          # step 1: tokens 0..39 (2 whole blocks, a third begun)
    prefill.table.mark_layer(1)                  # the layers' names sort 0, 1; any order works
    assert eventually(lambda: recv.blocks_equal(prefill.src, LAYERS[1], 2), True)
    assert all(recv.untouched(LAYERS[0], i) for i in range(5)), "layer 0 was not written yet"
    prefill.table.mark_step()
    assert eventually(lambda: recv.blocks_equal(prefill.src, LAYERS[0], 2), True)
    assert recv.untouched(LAYERS[0], 2) and recv.untouched(LAYERS[1], 2), "a partly written block was sent"
    prefill.step(40, 64)                         # step 2: up to 64 tokens: 4 whole blocks
    prefill.table.mark_step()
    assert eventually(lambda: recv.blocks_equal(prefill.src, LAYERS[0], 4), True)
    assert recv.untouched(LAYERS[0], 4), "the prompt's last, partial block went before the prompt was done"
    assert recv.thread is not None and recv.thread.is_alive()
    prefill.step(64, 70)                         # the last 6 tokens: the partial block may go
    prefill.table.mark_step()
    finish(recv)
    assert recv.error is None and recv.result is not None
    assert recv.result.nbytes == 5 * make_store(recv.dst, NUM_BLOCKS).layout.block_bytes
    for layer in LAYERS:
        assert recv.blocks_equal(prefill.src, layer, 5)


def test_prefix_cache_hits_go_with_the_steps_first_marks_and_a_local_hit_skips_blocks(prefill: Prefill) -> None:
    """P's prefix-cache hits (48 tokens: 3 blocks) may be blocks another request writes in this same
    forward: they count as written only with this step's marks, layer by layer."""
    recv = receive(prefill, first=2, local=[1, 2, 3])  # D has the first 2 blocks itself
    prefill.step(48, 70)
    time.sleep(0.3)
    assert all(recv.untouched(layer, i) for layer in LAYERS for i in range(3)), "sent before the forward wrote it"
    prefill.table.mark_layer(0)
    assert eventually(lambda: recv.blocks_equal(prefill.src, LAYERS[0], 3), True)
    assert recv.untouched(LAYERS[1], 0)
    prefill.table.mark_step()
    finish(recv)
    assert recv.error is None
    for layer in LAYERS:
        assert recv.blocks_equal(prefill.src, layer, 3)
        assert not recv.dst[layer][0].any()


def test_blocks_per_message_splits_a_layer_into_ordered_messages(prefill: Prefill) -> None:
    recv = receive(prefill, per_msg=2)
    prefill.step(0, 70)
    prefill.table.mark_step()
    finish(recv)
    assert recv.error is None
    for layer in LAYERS:
        assert recv.blocks_equal(prefill.src, layer, 5)


def test_an_aborted_request_ends_its_stream_and_close_waits_for_the_reader(prefill: Prefill) -> None:
    recv = receive(prefill)
    prefill.step(0, 32)
    prefill.table.mark_step()
    assert eventually(lambda: recv.blocks_equal(prefill.src, LAYERS[0], 2), True)
    prefill.table.bind_step({}, {KEY: "request aborted on the prefill engine"})  # what an abort's next step says
    finish(recv)
    assert isinstance(recv.error, FetchError) and "aborted" in str(recv.error)
    assert len(prefill.table) == 0


def test_close_blocks_until_a_read_in_progress_ends(prefill: Prefill) -> None:
    prefill.step(0, 70)
    stream = prefill.table.attach(KEY, 0, 70)
    assert not isinstance(stream, str)
    closed = threading.Event()
    with prefill.table.reading(stream):
        t = threading.Thread(target=lambda: (prefill.table.close(KEY, "preempted"), closed.set()), daemon=True)
        t.start()
        assert not closed.wait(0.2), "close returned while a listener thread still read the blocks"
    assert closed.wait(2)
    with pytest.raises(StreamClosed, match="preempted"), prefill.table.reading(stream):
        pass


def test_a_stream_finished_before_its_request_releases_the_lease_at_once(prefill: Prefill) -> None:
    recv = receive(prefill)
    prefill.step(0, 70)
    prefill.table.mark_step()
    finish(recv)
    prefill.leases.register("p-req", P_BLOCKS[:5], 30)   # the request finished: its lease arrives next step
    assert prefill.table.finished(KEY, "p-req") is True   # ... and the worker releases it at once
    assert prefill.leases.release("p-req")
    assert eventually(reaped(prefill.leases), ({"p-req"}, set())) == ({"p-req"}, set())
    assert len(prefill.table) == 0


def test_a_request_finished_before_its_stream_keeps_the_blocks_until_everything_is_sent(prefill: Prefill) -> None:
    prefill.step(0, 70)
    prefill.table.mark_step()
    prefill.leases.register("p-req", P_BLOCKS[:5], 30)
    assert prefill.table.finished(KEY, "p-req") is False  # nobody read it yet: the lease holds the blocks
    assert prefill.leases.reap() == (set(), set())
    recv = finish(receive(prefill))                       # D comes late; the stream's end releases the lease
    assert recv.error is None
    assert eventually(reaped(prefill.leases), ({"p-req"}, set())) == ({"p-req"}, set())
    assert len(prefill.table) == 0


def test_a_key_never_scheduled_is_refused_after_the_wait(prefill: Prefill) -> None:
    started = time.monotonic()
    recv = finish(receive(prefill, key="u" * 32))
    assert isinstance(recv.error, FetchError) and "no stream" in str(recv.error)
    assert 0.9 <= time.monotonic() - started < 3


def test_a_prompt_length_mismatch_is_refused_and_leaves_the_stream_to_the_right_reader(prefill: Prefill) -> None:
    prefill.step(0, 10)
    recv = finish(receive(prefill, num_tokens=71))
    assert isinstance(recv.error, FetchError) and "71 prompt tokens there, 70 here" in str(recv.error)
    past = finish(receive(prefill, first=5, local=[1]))
    assert isinstance(past.error, FetchError) and "past the prompt" in str(past.error)
    right = receive(prefill)
    prefill.step(10, 70)
    prefill.table.mark_step()
    assert finish(right).error is None


def test_close_cuts_a_reader_stuck_on_a_slow_decode_side(prefill: Prefill) -> None:
    """The engine thread's close() must not wait for a send that a slow reader holds up."""
    prefill.step(0, 70)
    ours, theirs = socket.socketpair()          # nobody reads ``theirs``: sends block once buffers fill
    stream = prefill.table.attach(KEY, 0, 70, conn=ours)
    assert not isinstance(stream, str)
    failed = threading.Event()

    def send_forever() -> None:
        try:
            with prefill.table.reading(stream):
                while True:
                    ours.sendall(b"x" * (1 << 20))
        except OSError:
            failed.set()

    threading.Thread(target=send_forever, daemon=True).start()
    time.sleep(0.3)
    started = time.monotonic()
    prefill.table.close(KEY, "preempted")
    assert time.monotonic() - started < 2 and failed.wait(2)
    ours.close()
    theirs.close()


def test_a_peer_cannot_release_a_streamed_lease_mid_stream(prefill: Prefill) -> None:
    from disagg_connectors.socket_connector.auth import client_handshake, listener_id
    from disagg_connectors.socket_connector.wire import set_io_timeout

    prefill.step(0, 70)
    prefill.table.mark_step()
    prefill.leases.register("p-req", P_BLOCKS[:5], 30)
    assert prefill.table.finished(KEY, "p-req") is False
    with socket.create_connection(("127.0.0.1", prefill.server.port), timeout=3) as sock:
        client_handshake(sock, SECRET, listener_id("127.0.0.1", prefill.server.port), 3)
        set_io_timeout(sock, 3)
        assert recv_frame(sock)["ok"]
        send_frame(sock, {"op": "release", "request_id": "p-req"})
        reply = recv_frame(sock)
    assert reply == {"ok": False, "error": "request p-req is streamed"}
    assert prefill.leases.reap() == (set(), set())     # still held for the stream
    assert finish(receive(prefill)).error is None
    assert eventually(reaped(prefill.leases), ({"p-req"}, set())) == ({"p-req"}, set())


def test_only_one_connection_reads_a_stream(prefill: Prefill) -> None:
    prefill.step(0, 10)
    first = receive(prefill)
    assert eventually(lambda: first.sock[0] is not None, True)
    time.sleep(0.1)
    second = finish(receive(prefill))
    assert isinstance(second.error, FetchError) and "already being read" in str(second.error)
    prefill.step(10, 70)
    prefill.table.mark_step()
    assert finish(first).error is None


def test_the_decode_side_cuts_a_stream_of_an_aborted_request(prefill: Prefill) -> None:
    recv = receive(prefill)
    prefill.step(0, 16)
    prefill.table.mark_step()
    assert eventually(lambda: recv.sock[0] is not None and recv.blocks_equal(prefill.src, LAYERS[0], 1), True)
    prefill.leases.register("p-req", P_BLOCKS[:1], 30)   # P's request finished meanwhile: the lease holds it
    assert prefill.table.finished(KEY, "p-req") is False
    sock = recv.sock[0]
    assert sock is not None
    sock.shutdown(socket.SHUT_RDWR)             # what SocketWorker._cancel_stream does
    finish(recv)
    assert isinstance(recv.error, FetchError)
    # The listener notices the reader left and frees P's blocks at once (no wait for the lease to expire).
    assert eventually(reaped(prefill.leases), ({"p-req"}, set())) == ({"p-req"}, set())
    assert len(prefill.table) == 0


def test_no_progress_ends_the_stream_with_a_reason(prefill: Prefill) -> None:
    prefill.server.io_timeout_s = 0.3
    prefill.step(0, 10)                          # scheduled, then nothing: the reader waits io_timeout_s
    recv = finish(receive(prefill))
    assert isinstance(recv.error, FetchError) and "no progress" in str(recv.error)


@pytest.mark.parametrize("ask", [
    {"op": "stream", "key": "short", "num_tokens": 10, "first_block": 0},
    {"op": "stream", "key": KEY + "!", "num_tokens": 10, "first_block": 0},
    {"op": "stream", "key": KEY, "num_tokens": "10", "first_block": 0},
    {"op": "stream", "key": KEY, "num_tokens": 10, "first_block": -1},
    {"op": "stream", "key": KEY, "num_tokens": 10, "first_block": 0, "blocks_per_message": 0},
])
def test_malformed_stream_requests_are_refused(prefill: Prefill, ask: dict) -> None:
    from disagg_connectors.socket_connector.auth import client_handshake, listener_id
    from disagg_connectors.socket_connector.wire import set_io_timeout

    with socket.create_connection(("127.0.0.1", prefill.server.port), timeout=3) as sock:
        client_handshake(sock, SECRET, listener_id("127.0.0.1", prefill.server.port), 3)
        set_io_timeout(sock, 3)
        assert recv_frame(sock)["ok"]
        send_frame(sock, ask)
        reply = recv_frame(sock)
    assert reply["ok"] is False and ("malformed" in reply["error"])


def test_a_key_used_by_another_request_is_not_streamed(prefill: Prefill) -> None:
    prefill.step(0, 10)
    refused = prefill.table.bind_step({KEY: StreamStep("other-req", 70, P_BLOCKS, 0, 10)}, {})
    assert refused == [KEY]
    stream = prefill.table.attach(KEY, 0, 70)
    assert not isinstance(stream, str) and stream.request_id == "p-req"


def test_a_streamed_fp8_transfer_equals_a_fetched_one() -> None:
    """wire_format fp8: each streamed message quantizes one layer's blocks; the decode side ends with
    the same cache contents as after a whole fetch (the scales are per segment, so per layer alike)."""
    from disagg_connectors.socket_connector.client import fetch

    caches = kv_caches(7)
    store = make_store(caches, NUM_BLOCKS, "fp8")
    table = StreamTable(BS, len(store.layout.layers))
    leases = LeaseTable()
    server = KVServer(store, leases, SECRET, "127.0.0.1", 0, io_timeout_s=3, streams=table, stream_wait_s=1.0)
    server.start()
    try:
        p = Prefill(server, table, leases, caches)
        recv = receive(p, per_msg=2, wire="fp8")
        p.step(0, 70)
        table.mark_layer(0)
        table.mark_step()
        finish(recv)
        assert recv.error is None
        whole = kv_caches(0, fill=False)
        leases.register("req-f", P_BLOCKS[:5], 30)
        fetch(FetchPlan("127.0.0.1", server.port, "req-f", P_BLOCKS[:5], recv.plan.local_block_ids), SECRET,
              make_store(whole, NUM_BLOCKS, "fp8"), FetchOptions(io_timeout_s=5))
    finally:
        server.close()
    for layer in LAYERS:
        assert torch.equal(recv.dst[layer], whole[layer])
        assert recv.dst[layer][20].any()


def test_the_decode_worker_cuts_a_stream_aborted_before_or_after_it_connected() -> None:
    from disagg_connectors.socket_connector.config import SocketSettings
    from disagg_connectors.socket_connector.worker import SocketWorker

    worker = SocketWorker(SocketSettings.load({}, {"DISAGG_KV_SECRET": "k" * 64}), "d", False, 0, 1, NUM_BLOCKS)
    worker._stream_socks["r1"] = None            # submitted, not connected yet (what start_load_kv records)
    worker._cancel_stream("r1")
    a, b = socket.socketpair()
    worker._track("r1", a)                       # connects after the abort: cut at once
    assert b.recv(1) == b""
    worker._stream_over("r1")
    worker._stream_socks["r2"] = None
    c, d = socket.socketpair()
    worker._track("r2", c)
    worker._cancel_stream("r2")                  # aborted while connected: cut at once
    assert d.recv(1) == b""
    worker._stream_over("r2")
    worker._cancel_stream("r3")                  # never streamed: nothing kept
    assert worker._stream_socks == {} and worker._cancelled == set()
    for sock in (a, b, c, d):
        sock.close()


# abandoned streams: no lease held for a reader that never comes


def abandon(p: Prefill, key: str = KEY) -> bool:
    plan = FetchPlan("127.0.0.1", p.server.port, "", [], [], stream_key=key, num_tokens=70)
    conns = PeerConnections(SECRET, make_store(kv_caches(0, fill=False), NUM_BLOCKS), FetchOptions(io_timeout_s=5))
    try:
        return conns.release(plan)  # a streamed plan's release is op abandon
    finally:
        conns.close()


def test_a_stream_abandoned_after_its_request_finished_releases_the_lease_at_once(prefill: Prefill) -> None:
    prefill.step(0, 70)
    prefill.table.mark_step()
    prefill.leases.register("p-req", P_BLOCKS[:5], 30)
    assert prefill.table.finished(KEY, "p-req") is False   # the lease waits for a reader ...
    assert abandon(prefill)                                 # ... who says it never comes
    assert eventually(reaped(prefill.leases), ({"p-req"}, set())) == ({"p-req"}, set())
    assert len(prefill.table) == 0


def test_a_stream_abandoned_while_computed_keeps_no_lease_when_it_finishes(prefill: Prefill) -> None:
    prefill.step(0, 40)
    assert abandon(prefill)
    recv = finish(receive(prefill))                          # nobody may read it any more
    assert isinstance(recv.error, FetchError) and "ended" in str(recv.error)
    prefill.step(40, 70)
    prefill.table.mark_step()
    prefill.leases.register("p-req", P_BLOCKS[:5], 30)
    assert prefill.table.finished(KEY, "p-req") is True     # the worker releases the lease at once


def test_a_key_abandoned_before_its_request_was_scheduled_keeps_no_lease(prefill: Prefill) -> None:
    assert abandon(prefill, "a" * 32)
    prefill.step(0, 70, key="a" * 32, rid="late-req")         # P gets to it later (it was queued)
    prefill.table.mark_step()
    prefill.leases.register("late-req", P_BLOCKS[:5], 30)
    assert prefill.table.finished("a" * 32, "late-req") is True
    assert len(prefill.table) == 0


def test_a_reader_that_gave_up_waiting_abandons_the_key(prefill: Prefill) -> None:
    """D waited stream_wait_s for P to schedule the request, then computed it itself: when P's queue
    reaches the request, its stream keeps no lease."""
    recv = finish(receive(prefill, key="q" * 32))
    assert isinstance(recv.error, FetchError) and "not scheduled within" in str(recv.error)
    prefill.step(0, 70, key="q" * 32, rid="queued-req")
    prefill.table.mark_step()
    prefill.leases.register("queued-req", P_BLOCKS[:5], 30)
    assert prefill.table.finished("q" * 32, "queued-req") is True


def test_abandon_leaves_a_stream_being_read_alone(prefill: Prefill) -> None:
    recv = receive(prefill)
    prefill.step(0, 40)
    prefill.table.mark_step()
    assert eventually(lambda: recv.blocks_equal(prefill.src, LAYERS[0], 2), True)
    assert abandon(prefill)                                  # someone else's abandon: the reader goes on
    prefill.step(40, 70)
    prefill.table.mark_step()
    assert finish(recv).error is None
    for layer in LAYERS:
        assert recv.blocks_equal(prefill.src, layer, 5)


def test_abandoned_keys_are_remembered_within_bounds() -> None:
    from disagg_connectors.socket_connector import streams as streams_mod

    now = [0.0]
    table = StreamTable(BS, 2, clock=lambda: now[0])
    for i in range(streams_mod.ABANDONED_MAX + 10):
        table.abandon(f"{i:032d}")
    assert len(table._abandoned) == streams_mod.ABANDONED_MAX
    assert f"{0:032d}" not in table._abandoned               # the oldest went first
    now[0] = streams_mod.ABANDONED_TTL_S + 1
    table.abandon("n" * 32)
    assert list(table._abandoned) == ["n" * 32]             # the rest were too old


def test_a_malformed_abandon_is_refused(prefill: Prefill) -> None:
    from disagg_connectors.socket_connector.auth import client_handshake, listener_id
    from disagg_connectors.socket_connector.wire import set_io_timeout

    with socket.create_connection(("127.0.0.1", prefill.server.port), timeout=3) as sock:
        client_handshake(sock, SECRET, listener_id("127.0.0.1", prefill.server.port), 3)
        set_io_timeout(sock, 3)
        assert recv_frame(sock)["ok"]
        send_frame(sock, {"op": "abandon", "key": ["not", "a", "key"]})
        reply = recv_frame(sock)
    assert reply["ok"] is False and "malformed stream key" in reply["error"]
