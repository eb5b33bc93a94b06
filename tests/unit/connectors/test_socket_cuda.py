"""The socket connector's accelerator paths on a real CUDA device, no engine: what vLLM's GPU
worker hands the connector (caches in device memory, an event per layer recorded on the stream
that wrote it) through a real listener and a real decode-side store.

- a streamed layer is read only once the event the forward recorded after writing it has
  completed: the writes run on a side stream behind a long GPU kernel, so a read that did not
  wait would copy the blocks as they were before (zeros);
- fp8 on the wire: the device quantizes to the same bytes as the CPU does (the two engines of a
  pair may sit on different devices), and a CUDA -> CUDA transfer, fetched or streamed, lands
  within the format's documented error bound.

Skipped where no CUDA device is present (absent hardware): run on a GPU machine with
``python -m pytest tests/unit/connectors/test_socket_cuda.py``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from disagg_connectors.socket_connector.client import FetchOptions, FetchPlan, PeerConnections, fetch
from disagg_connectors.socket_connector.config import FP8_GROUP, FP8_SCALE_BYTES
from disagg_connectors.socket_connector.layout import StagedStore, make_store
from disagg_connectors.socket_connector.leases import LeaseTable
from disagg_connectors.socket_connector.metadata import StreamStep
from disagg_connectors.socket_connector.server import KVServer
from disagg_connectors.socket_connector.streams import StreamTable
from disagg_connectors.socket_connector.wireformat import Fp8Store, encode, fp8_segment_bytes, groups_of

from tests.unit.connectors.kvdata import NUM_BLOCKS, SECRET, kv_caches

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (absent hardware)")

KEY = "c" * 32
BS = 16
P_BLOCKS = [9, 3, 17, 4, 30]             # the prefill request's blocks: 70 tokens, the last block partial
D_BLOCKS = [20, 21, 22, 23, 24]
#: GPU clock cycles a layer's write waits behind (about 0.1 s at the H100/H200's clocks)
SPIN_CYCLES = 200_000_000


def on_cuda(caches: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.to("cuda") for name, t in caches.items()}


def serve(src: dict[str, torch.Tensor], wire: str) -> tuple[KVServer, StreamTable, LeaseTable]:
    store = make_store(src, NUM_BLOCKS, wire)
    assert isinstance(store, StagedStore)        # device caches always go through host staging
    table = StreamTable(BS, len(store.layout.layers))
    leases = LeaseTable()
    server = KVServer(store, leases, SECRET, "127.0.0.1", 0, io_timeout_s=10, streams=table, stream_wait_s=5.0)
    server.start()
    return server, table, leases


def stream_into(server: KVServer, dst: dict[str, torch.Tensor], wire: str) -> tuple[threading.Thread, list]:
    """A decode side receiving the request's stream into ``dst`` in a thread; the list gets its
    result or its error."""
    plan = FetchPlan("127.0.0.1", server.port, KEY, list(range(len(D_BLOCKS))), D_BLOCKS,
                     stream_key=KEY, num_tokens=70, first_block=0)
    out: list = []

    def run() -> None:
        with PeerConnections(SECRET, make_store(dst, NUM_BLOCKS, wire), FetchOptions(io_timeout_s=10)) as conns:
            try:
                out.append(conns.stream(plan, lambda _s: None))
            except BaseException as exc:  # handed to the test thread
                out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def forward_writes(src: dict[str, torch.Tensor], data: dict[str, torch.Tensor], table: StreamTable) -> None:
    """A prefill forward on a side stream: each layer's KV is written behind a long kernel, then an
    event is recorded and handed to the stream table (as the worker's ``save_layer`` does); the host
    returns long before the device has written anything."""
    table.bind_step({KEY: StreamStep("p-req", 70, list(P_BLOCKS), 0, 70)}, {})
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for i, name in enumerate(sorted(src)):
            torch.cuda._sleep(SPIN_CYCLES)
            src[name].copy_(data[name], non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            table.mark_layer(i, event)
        done = torch.cuda.Event()
        done.record()
        table.mark_step(done)
    assert not done.query(), "the device finished before the host: the test proves nothing; raise SPIN_CYCLES"


def within_fp8_bound(got: torch.Tensor, want: torch.Tensor) -> bool:
    """``got`` is ``want`` through e4m3 (wireformat's accuracy statement: at most 1/16 of each
    element's magnitude, or 2^-10/440 of its group's largest, plus bf16's own rounding). A block
    here is one segment, its groups runs of :data:`FP8_GROUP` elements."""
    g, w = got.float().reshape(-1, FP8_GROUP), want.float().reshape(-1, FP8_GROUP)
    amax = w.abs().amax(dim=1, keepdim=True)
    allowed = torch.maximum(w.abs() / 16, amax * 2.0 ** -10 / 440) + w.abs() * 2.0 ** -8
    return bool(((g - w).abs() <= allowed).all())


@contextmanager
def streamed_from_device(wire: str) -> Iterator[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], KVServer,
                                                       LeaseTable]]:
    """A listener serving device caches, and a decode side's device caches that received one
    request streamed while the forward wrote it (:func:`forward_writes`); yields (what the forward
    wrote, what arrived, the listener, its leases); the listener is closed on leaving."""
    data = on_cuda(kv_caches(7))
    src = on_cuda(kv_caches(0, fill=False))
    torch.cuda.synchronize()
    server, table, leases = serve(src, wire)
    try:
        dst = on_cuda(kv_caches(0, fill=False))
        thread, out = stream_into(server, dst, wire)
        forward_writes(src, data, table)
        thread.join(30)
        assert not thread.is_alive() and out and not isinstance(out[0], BaseException), out
        yield data, dst, server, leases
    finally:
        server.close()


def test_a_stream_from_device_caches_waits_for_each_layers_event() -> None:
    with streamed_from_device("raw") as (data, dst, _, _):
        pass
    for name in data:
        for p, d in zip(P_BLOCKS, D_BLOCKS, strict=True):
            assert torch.equal(dst[name][d], data[name][p]), (name, p, d)
            assert dst[name][d].any()


def test_the_device_quantizes_to_the_same_wire_bytes_as_the_cpu() -> None:
    """The wire format does not depend on where a cache lives: a CPU prefill engine and a GPU one
    send the same bytes for the same KV (scales and e4m3 codes)."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = (torch.randn(2, 6, 4096, generator=torch.Generator().manual_seed(3)) * 3).to(dtype)
        x[0, 1] = 0                               # an all-zero group: scale 1
        x[1, 2, :128] *= 1e-4                     # a tiny group
        out_cpu = torch.empty(2, 6, fp8_segment_bytes(4096), dtype=torch.uint8)
        out_dev = torch.empty_like(out_cpu, device="cuda")
        # a host staging slice, as a GPU prefill engine fills it: rows contiguous, the slice not
        staged = torch.empty(2, 10, fp8_segment_bytes(4096), dtype=torch.uint8)[:, :6, :]
        encode(x, out_cpu)
        encode(x.to("cuda"), out_dev)
        encode(x.to("cuda"), staged)
        assert groups_of(4096) * FP8_SCALE_BYTES < out_cpu.shape[2]
        assert torch.equal(out_dev.cpu(), out_cpu), dtype
        assert torch.equal(staged, out_cpu), dtype


def test_fp8_between_device_caches_fetched_and_streamed_stays_within_the_bound() -> None:
    with streamed_from_device("fp8") as (data, streamed, server, leases):
        fetched = on_cuda(kv_caches(0, fill=False))
        store = make_store(fetched, NUM_BLOCKS, "fp8")
        assert isinstance(store, Fp8Store)
        leases.register("req-f", list(P_BLOCKS), 30)
        fetch(FetchPlan("127.0.0.1", server.port, "req-f", list(P_BLOCKS), D_BLOCKS), SECRET, store,
              FetchOptions(io_timeout_s=10))
    for name in data:
        assert torch.equal(streamed[name], fetched[name]), name
        for p, d in zip(P_BLOCKS, D_BLOCKS, strict=True):
            assert fetched[name][d].any()
            assert within_fp8_bound(fetched[name][d], data[name][p]), (name, p, d)
