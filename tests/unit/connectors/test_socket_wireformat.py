"""The fp8 wire format (wireformat.py): encoding, the store's round trip, whole fetches over a real
listener, and a pair that disagrees on the format refusing to transfer."""

from __future__ import annotations

import pytest
import torch
from disagg_connectors.socket_connector.client import FetchError, FetchOptions, FetchPlan, fetch
from disagg_connectors.socket_connector.config import FP8_GROUP, FP8_SCALE_BYTES, ConfigError, SocketSettings
from disagg_connectors.socket_connector.counters import TransferCounters
from disagg_connectors.socket_connector.layout import LayoutError, make_store
from disagg_connectors.socket_connector.leases import LeaseTable
from disagg_connectors.socket_connector.server import KVServer
from disagg_connectors.socket_connector.wireformat import (
    FP8_TARGET,
    Fp8Store,
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
