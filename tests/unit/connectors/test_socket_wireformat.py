"""The fp8 wire format (wireformat.py): encoding, the store's round trip, whole fetches over a real
listener, and a pair that disagrees on the format refusing to transfer."""

from __future__ import annotations

import time

import pytest
import torch
from disagg_connectors.socket_connector.client import FetchError, FetchOptions, FetchPlan, fetch
from disagg_connectors.socket_connector.config import FP8_GROUP, FP8_SCALE_BYTES, ConfigError, SocketSettings
from disagg_connectors.socket_connector.counters import TransferCounters
from disagg_connectors.socket_connector.layout import LayoutError, make_store
from disagg_connectors.socket_connector.leases import LeaseTable
from disagg_connectors.socket_connector.server import KVServer
from disagg_connectors.socket_connector.wire import WireError
from disagg_connectors.socket_connector.wireformat import (
    FP8_TARGET,
    Fp8Store,
    check_scales,
    decode,
    encode,
    fp8_segment_bytes,
    groups_of,
)

from tests.unit.connectors.kvdata import NUM_BLOCKS, SECRET, kv_caches

# kvdata's caches: [32 blocks, 2 heads, 16 tokens, 128] bf16 -> one segment of 4,096 elements per block
ELEMS = 2 * 16 * 128


def _relative_error_ok(got: torch.Tensor, want: torch.Tensor) -> None:
    """Every element within e4m3's half unit in the last place (1/16 of its magnitude), or, for
    values in e4m3's subnormal range, within 2^-10 of the group's scale; widened by the cache
    dtype's own rounding of the scaled and the decoded value (two roundings of eps/2 each, relative
    to a 1/16 bound: a factor 1 + 16 eps) and its subnormals' spacing."""
    want32, got32 = want.float(), got.float()
    groups = want32.reshape(-1, FP8_GROUP)
    scale = (groups.abs().amax(dim=1, keepdim=True) / FP8_TARGET).expand_as(groups).reshape(want32.shape)
    info = torch.finfo(want.dtype)
    bound = torch.maximum(want32.abs() / 16, scale * 2 ** -10) * (1 + 16 * info.eps) + info.tiny * info.eps
    assert bool(((got32 - want32).abs() <= bound).all()), float(((got32 - want32).abs() / bound).max())


def test_segment_sizes_are_scales_then_one_byte_per_element() -> None:
    assert groups_of(ELEMS) == ELEMS // FP8_GROUP
    assert fp8_segment_bytes(ELEMS) == ELEMS // FP8_GROUP * FP8_SCALE_BYTES + ELEMS
    assert groups_of(100) == 1 and fp8_segment_bytes(100) == FP8_SCALE_BYTES + 100
    # about half of bf16's 2 bytes per element
    assert fp8_segment_bytes(ELEMS) / (2 * ELEMS) == pytest.approx(0.5 + FP8_SCALE_BYTES / (2 * FP8_GROUP))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_encode_then_decode_is_within_e4m3_precision(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    # groups of very different magnitudes, an all-zero group, and values far above e4m3's range
    x = (torch.randn(2, 5, ELEMS, generator=g) * torch.logspace(-6, 4, 5).view(1, 5, 1)).to(dtype)
    x[0, 1, :FP8_GROUP] = 0
    x[1, 2, :FP8_GROUP] = 1e4
    out = torch.empty(2, 5, fp8_segment_bytes(ELEMS), dtype=torch.uint8)
    encode(x, out)
    back = decode(out, ELEMS, dtype, torch.device("cpu"))
    assert back.dtype == dtype and back.shape == x.shape
    assert torch.isfinite(back).all()
    assert not back[0, 1, :FP8_GROUP].any()
    _relative_error_ok(back, x)
    # the scales lead each segment, as float32: the inverse of the factor each group was multiplied by
    scales = out[0, 0, : groups_of(ELEMS) * FP8_SCALE_BYTES].clone().view(torch.float32)
    factors = FP8_TARGET / x.float().reshape(-1, FP8_GROUP).abs().amax(dim=1)
    # multiplied in the cache's dtype, unless a factor overflows it (fp16 here: the 1e-6 groups)
    in_float32 = bool(factors[torch.isfinite(factors)].max() > torch.finfo(dtype).max)
    assert in_float32 == (dtype == torch.float16)
    first = factors[: groups_of(ELEMS)]
    assert torch.equal(scales, 1.0 / (first if in_float32 else first.to(dtype).float()))


def test_the_store_reads_fewer_bytes_and_writes_back_what_it_read() -> None:
    src, dst = kv_caches(11), kv_caches(0, fill=False)
    p, d = make_store(src, NUM_BLOCKS, "fp8"), make_store(dst, NUM_BLOCKS, "fp8")
    assert isinstance(p, Fp8Store) and p.layout.wire == "fp8"
    raw = make_store(src, NUM_BLOCKS)
    assert p.layout.block_bytes == 2 * fp8_segment_bytes(ELEMS) < 0.52 * raw.layout.block_bytes
    assert p.layout.fingerprint()[-1] == ["wire", "fp8"]
    assert p.layout.fingerprint()[:-1] != raw.layout.fingerprint()    # segment sizes differ too
    remote, local = [9, 3, 4, 31], [0, 7, 8, 30]
    with p.reading(remote) as out_views:
        payload = b"".join(bytes(v) for v in out_views)
    assert len(payload) == len(remote) * p.layout.block_bytes
    with d.writing(local) as in_views:
        at = 0
        for v in in_views:
            v[:] = payload[at : at + v.nbytes]
            at += v.nbytes
    for name in src:
        for r, loc in zip(remote, local, strict=True):
            _relative_error_ok(dst[name][loc], src[name][r])
        assert not dst[name][1].any()     # blocks not written stay as they were


def test_a_failed_write_leaves_the_cache_untouched() -> None:
    dst = kv_caches(0, fill=False)
    store = make_store(dst, NUM_BLOCKS, "fp8")
    with pytest.raises(RuntimeError, match="mid-transfer"), store.writing([2, 3]) as views:
        views[0][:4] = b"\xff\xff\xff\xff"
        raise RuntimeError("mid-transfer")
    assert not any(t.any() for t in dst.values())


def test_fp8_needs_a_wider_cache() -> None:
    caches = {"l0": torch.zeros(NUM_BLOCKS, 2, 16, 128, dtype=torch.int8)}
    with pytest.raises(LayoutError, match="bf16, fp16 or fp32"):
        make_store(caches, NUM_BLOCKS, "fp8")
    with pytest.raises(LayoutError, match="unknown wire format"):
        make_store(kv_caches(0, fill=False), NUM_BLOCKS, "zstd")


def test_settings_accept_raw_and_fp8_only() -> None:
    env = {"DISAGG_KV_SECRET": "ab" * 32}
    assert SocketSettings.load({}, env).wire_format == "raw"
    assert SocketSettings.load({"wire_format": "fp8"}, env).wire_format == "fp8"
    with pytest.raises(ConfigError, match="wire_format: expected one of raw, fp8, got 'int4'"):
        SocketSettings.load({"wire_format": "int4"}, env)


def _listener(wire: str) -> tuple[KVServer, dict[str, torch.Tensor]]:
    caches = kv_caches(5)
    server = KVServer(make_store(caches, NUM_BLOCKS, wire), LeaseTable(), SECRET, "127.0.0.1", 0,
                      registration_wait_s=0.2, io_timeout_s=5, counters=TransferCounters())
    server.start()
    return server, caches


@pytest.mark.parametrize("streams", [1, 2])
def test_a_fetch_in_fp8_moves_half_the_bytes(streams: int) -> None:
    server, src = _listener("fp8")
    try:
        remote, local = [1, 2, 3, 17, 30], [4, 5, 6, 7, 8]
        server.leases.register("r", remote, 30)
        dst = kv_caches(0, fill=False)
        store = make_store(dst, NUM_BLOCKS, "fp8")
        result = fetch(FetchPlan("127.0.0.1", server.port, "r", remote, local), SECRET, store,
                       FetchOptions(streams=streams, blocks_per_message=2, io_timeout_s=5))
        assert result.nbytes == len(remote) * store.layout.block_bytes
        assert result.nbytes < 0.52 * len(remote) * make_store(src, NUM_BLOCKS).layout.block_bytes
        for name in src:
            for r, loc in zip(remote, local, strict=True):
                _relative_error_ok(dst[name][loc], src[name][r])
    finally:
        server.close()


@pytest.mark.parametrize(("theirs", "ours"), [("fp8", "raw"), ("raw", "fp8")])
def test_a_pair_that_disagrees_on_the_wire_format_refuses_with_a_hint(theirs: str, ours: str) -> None:
    server, _ = _listener(theirs)
    try:
        server.leases.register("r", [1], 30)
        dst = kv_caches(0, fill=False)
        with pytest.raises(FetchError, match=f"wire format '{theirs}' there, '{ours}' here"):
            fetch(FetchPlan("127.0.0.1", server.port, "r", [1], [1]), SECRET,
                  make_store(dst, NUM_BLOCKS, ours), FetchOptions(io_timeout_s=5))
        assert not any(t.any() for t in dst.values())
        assert len(server.leases) == 1           # nothing fetched: the lease is untouched
    finally:
        server.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_wire_ratio_is_what_the_store_puts_on_the_wire(dtype: torch.dtype) -> None:
    """config.wire_ratio (what `disagg plan` prices) equals the fp8 store's real block size."""
    from disagg_connectors.socket_connector.config import wire_ratio

    caches = {k: v.to(dtype) for k, v in kv_caches(1).items()}
    raw, fp8 = make_store(caches, NUM_BLOCKS).layout, make_store(caches, NUM_BLOCKS, "fp8").layout
    element = torch.tensor([], dtype=dtype).element_size()
    assert fp8.block_bytes == pytest.approx(raw.block_bytes * wire_ratio("fp8", element))
    assert wire_ratio("raw", element) == 1.0
    with pytest.raises(ValueError, match="2 or 4 bytes"):
        wire_ratio("fp8", 1)


def test_the_fast_e4m3_reader_gives_every_finite_code_its_value() -> None:
    from disagg_connectors.socket_connector.wireformat import e4m3_to_bf16_scaled

    codes = torch.arange(256, dtype=torch.uint8)
    exact = codes.view(torch.float8_e4m3fn).float()
    finite = torch.isfinite(exact)
    for scale in (1.0, 2.0 ** -20, 300.0):      # 300: past the folded multiply's range, two steps
        got = e4m3_to_bf16_scaled(codes, torch.tensor([scale])).float()
        assert torch.equal(got[finite], (exact[finite] * scale).to(torch.bfloat16).float()), scale


def test_fp8_messages_stay_near_4_mib_so_conversion_overlaps_the_wire() -> None:
    from disagg_connectors.socket_connector.layout import KVLayout, LayerLayout
    from disagg_connectors.socket_connector.wireformat import default_blocks_per_message

    def layout(seg_bytes: int, wire: str) -> KVLayout:
        return KVLayout((LayerLayout("l0", 1, 32, seg_bytes), LayerLayout("l1", 1, 32, seg_bytes)), wire=wire)

    assert default_blocks_per_message(layout(1 << 20, "raw")) == 64
    # a message is one layer's blocks: 1 MiB a block there, 4 MiB a message, however many layers
    assert default_blocks_per_message(layout(1 << 20, "fp8")) == 4
    assert default_blocks_per_message(layout(5 << 20, "fp8")) == 1           # never below one block
    assert default_blocks_per_message(layout(1 << 10, "fp8")) == 64          # nor above the raw default
    # layers of different sizes: the largest layer's message stays within 4 MiB
    uneven = KVLayout((LayerLayout("l0", 1, 32, 1 << 18), LayerLayout("l1", 2, 32, 1 << 19)), wire="fp8")
    assert default_blocks_per_message(uneven) == 4                           # l1: 1 MiB a block
    assert SocketSettings.load({}, {"DISAGG_KV_SECRET": "ab" * 32}).blocks_per_message is None


def test_a_converting_store_moves_a_message_layer_by_layer_with_the_same_wire_bytes() -> None:
    """The listener and the fetch read/write fp8 messages one layer at a time (so that one layer
    converts while another is on the wire): the bytes must be the whole message's, in order."""
    src = kv_caches(5)
    fp8, raw = make_store(src, NUM_BLOCKS, "fp8"), make_store(src, NUM_BLOCKS)
    assert raw.message_layers() == [None]                          # the cache's own memory: one call
    runs = fp8.message_layers()
    assert runs == [[i] for i in range(len(fp8.layout.layers))]
    blocks = [9, 3, 4]
    with fp8.reading(blocks) as whole:
        expected = b"".join(bytes(v) for v in whole)
    parts = []
    for layers in runs:
        with fp8.reading(blocks, layers) as views:
            parts.append(b"".join(bytes(v) for v in views))
    assert b"".join(parts) == expected


# -- the decode side refuses scales encode() never writes -------------------------

BAD_SCALES = [pytest.param(float("nan"), id="nan"), pytest.param(float("inf"), id="inf"),
              pytest.param(float("-inf"), id="-inf")]


def _poison(host: torch.Tensor, value: float) -> None:
    """Set the first scale of every segment of a staged fp8 message (uint8 ``(outer, n, bytes)``) to ``value``."""
    host[:, :, :FP8_SCALE_BYTES].view(torch.float32).fill_(value)


@pytest.mark.parametrize("bad", BAD_SCALES)
def test_a_message_with_a_non_finite_scale_is_refused_and_writes_nothing(bad: float) -> None:
    src, dst = kv_caches(11), kv_caches(12)
    before = {name: t.clone() for name, t in dst.items()}
    p, d = make_store(src, NUM_BLOCKS, "fp8"), make_store(dst, NUM_BLOCKS, "fp8")
    remote, local = [9, 3], [0, 7]
    with p.reading(remote) as out_views:
        payload = b"".join(bytes(v) for v in out_views)
    with pytest.raises(WireError, match="NaN or infinite"), d.writing(local) as in_views:
        at = 0
        for v in in_views:
            v[:] = payload[at : at + v.nbytes]
            at += v.nbytes
        bad_scale = torch.tensor([bad], dtype=torch.float32).view(torch.uint8).numpy().tobytes()
        in_views[-1][:FP8_SCALE_BYTES] = bad_scale   # the last layer's first scale: earlier layers are sound
    for name in dst:  # not one layer written, although all but the last were sound
        assert torch.equal(dst[name], before[name]), name
    with d.writing(local) as in_views:  # control: the same message unpoisoned is written
        at = 0
        for v in in_views:
            v[:] = payload[at : at + v.nbytes]
            at += v.nbytes
    assert not all(torch.equal(dst[name], before[name]) for name in dst)


@pytest.mark.parametrize("bad", BAD_SCALES)
def test_check_scales_names_what_it_refuses(bad: float) -> None:
    wire = torch.zeros(2, 3, fp8_segment_bytes(ELEMS), dtype=torch.uint8)
    wire[:, :, :FP8_SCALE_BYTES].view(torch.float32).fill_(1.0)
    check_scales(wire, ELEMS)                                      # finite: accepted
    wire[1, 2, FP8_SCALE_BYTES : 2 * FP8_SCALE_BYTES].view(torch.float32).fill_(bad)   # one group of one block
    with pytest.raises(WireError, match=f"1 of {2 * 3 * groups_of(ELEMS)} scales"):
        check_scales(wire, ELEMS)


@pytest.mark.parametrize("bad", BAD_SCALES)
def test_a_fetch_carrying_non_finite_scales_fails_counted_and_writes_nothing(
        bad: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the workers: the fetch is reported failed (vLLM recomputes), counted in
    num_failed_transfers, the decode cache is untouched and the prefill side's lease is still released."""
    from disagg_connectors.socket_connector.metadata import RecvSpec, SendSpec, SocketConnectorMetadata
    from disagg_connectors.socket_connector.worker import SocketWorker

    env = {"DISAGG_KV_SECRET": "f" * 64}
    p = SocketWorker(SocketSettings.load({"host": "127.0.0.1", "port": 0, "registration_wait_s": 0.2,
                                          "wire_format": "fp8"}, env, need_port=True), "engine-p", True, 0, 1,
                     NUM_BLOCKS)
    d = SocketWorker(SocketSettings.load({"io_timeout_s": 2, "wire_format": "fp8", "streams": 2}, env),
                     "engine-d", False, 0, 1, NUM_BLOCKS)
    p_caches, d_caches = kv_caches(5), kv_caches(6)
    before = {name: t.clone() for name, t in d_caches.items()}
    try:
        p.register_kv_caches(p_caches)
        d.register_kv_caches(d_caches)
        assert isinstance(p.store, Fp8Store) and p.server is not None
        sound_pack = p.store._pack

        def poisoned(blocks: torch.Tensor, host: torch.Tensor) -> None:
            sound_pack(blocks, host)
            _poison(host, bad)

        monkeypatch.setattr(p.store, "_pack", poisoned)
        p.start_load_kv(SocketConnectorMetadata(reqs_to_send={"p1": SendSpec([2, 3, 4], 30)}))
        spec = RecvSpec(local_block_ids=[7, 8, 9], remote_block_ids=[2, 3, 4], remote_request_id="p1",
                        remote_host="127.0.0.1", remote_port=p.server.port, remote_tp_size=1, awaiting=True,
                        remote_engine_id="engine-p")
        d.start_load_kv(SocketConnectorMetadata(reqs_to_recv={"d1": spec}))
        failed: set[str] = set()
        deadline = time.monotonic() + 10
        while "d1" not in failed and time.monotonic() < deadline:   # polled as vLLM does each step
            failed |= d.get_transfer_results(idle_step=True).failed_recving
        assert failed == {"d1"}
        drained = d.counters.drain()
        assert drained is not None and drained["num_failed_transfers"] == [1]
        assert not drained["bytes_transferred"]
        for name in d_caches:
            assert torch.equal(d_caches[name], before[name]), name
        sent: set[str] = set()
        deadline = time.monotonic() + 10
        while "p1" not in sent and time.monotonic() < deadline:    # released, not left to expire
            sent |= p.get_transfer_results(idle_step=True).finished_sending
        assert sent == {"p1"}
    finally:
        p.shutdown()
        d.shutdown()
