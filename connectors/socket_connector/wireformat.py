"""Wire formats of the socket connector: ``raw`` (default) and ``fp8`` (opt-in, lossy).

``raw`` sends the cache's own bytes (layout.py's stores). ``fp8`` halves a
bf16/fp16 cache's bytes on the wire (a quarter of fp32): the prefill side
quantizes each chunk of blocks to float8 e4m3 before sending, the decode side
dequantizes into its own cache dtype after receiving. Selected with
``kv_connector_extra_config.wire_format`` on both engines; the wire format is
part of the layout fingerprint both sides compare in the hello (config.py,
client.connect), so a pair that disagrees refuses to transfer (and the decode
engine, under ``kv_load_failure_policy: recompute``, prefills locally).

Encoding. Each layer is an ``(outer, num_blocks, elems)`` array of the cache's
element type (layout.py). A segment (one block of one outer index) is cut into
groups of :data:`FP8_GROUP` elements (one group when ``elems`` is not a multiple of
it); each group gets its own scale, about ``amax / 440`` (float32; 1 for an
all-zero group), and its elements become ``e4m3(x / scale)``. On the wire a segment is
its groups' float32 scales followed by its fp8 elements, and the stream order is
layout.py's: per chunk, per layer, per outer index, each block in list order.
The wire layout (:attr:`Fp8Store.layout`) therefore is the raw one with each
segment's byte size replaced, and ``["wire", "fp8"]`` added to its fingerprint.
The decode side refuses a message with a NaN or infinite scale before writing
any of it (:func:`check_scales`): the transfer fails and the prompt is recomputed.

Accuracy: e4m3 keeps 3 mantissa bits, so an element's error is at most 1/16 of
its own magnitude (half a unit in the last place) down to 2^-6 / 440 of its
group's largest magnitude; below that (e4m3 subnormals) at most 2^-10 / 440 of
that largest, absolute (plus the 16-bit dtype's own rounding of the scaled
value, 2^-9 relative). What this costs a model's answers must be measured on a real model
(benchmarks/gpu/verify.sh); a random-weight model says nothing about it.

Cost: both sides go through staging buffers (one per thread, grown on demand)
and torch conversions, on the prefill engine's and the decode engine's CPU
(host caches) or device (accelerator caches).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .config import BLOCKS_PER_MESSAGE, FP8_GROUP, FP8_SCALE_BYTES, WIRE_FORMATS
from .layout import KVLayout, LayerLayout, LayoutError, StagedStore
from .wire import WireError

__all__ = ["WIRE_FORMATS", "Fp8Store", "check_scales", "decode", "default_blocks_per_message",
           "e4m3_to_bf16_scaled", "encode", "fp8_segment_bytes", "groups_of"]
#: the largest finite float8 e4m3 (fn) value
FP8_MAX = 448.0
#: what a group's largest magnitude is scaled to: below FP8_MAX by more than the rounding of the
#: scale factor in a 16-bit dtype (2^-8 relative), so no scaled value can overflow e4m3
FP8_TARGET = 440.0
#: cache element types fp8 applies to (an fp8 cache gains nothing)
FP8_SOURCES = (torch.bfloat16, torch.float16, torch.float32)
_FP8 = torch.float8_e4m3fn
#: fp8 messages are converted before they are sent, so they stay near this many wire bytes (one
#: message converts while another is on the wire); raw data goes straight from the cache in
#: config.BLOCKS_PER_MESSAGE-block scatter-gather writes
FP8_MESSAGE_BYTES = 4 << 20


def default_blocks_per_message(layout: KVLayout) -> int:
    """Blocks per fetch message for a store's wire layout, when ``blocks_per_message`` is unset.

    An fp8 message holds one layer's blocks (:meth:`Fp8Store.message_layers`, a staged store's),
    so it is up to :data:`FP8_MESSAGE_BYTES` of the largest layer's blocks, at least one and at
    most :data:`~.config.BLOCKS_PER_MESSAGE` (2.2 MB for Llama-3.1-8B). Sized by a block across
    all layers instead, a Llama-3.1-8B message was 3 blocks of one layer (100 KB), and each
    message's fixed costs (a device sync, kernel launches, the block index) made staging a
    2,048-token KV on an H200 take 410 ms where its raw bytes took 13."""
    if layout.wire == "raw":
        return BLOCKS_PER_MESSAGE
    largest = max((layer.block_bytes for layer in layout.layers), default=1)
    return max(1, min(BLOCKS_PER_MESSAGE, FP8_MESSAGE_BYTES // max(1, largest)))


def groups_of(elems: int) -> int:
    """Scales per segment of ``elems`` elements."""
    return elems // FP8_GROUP if elems % FP8_GROUP == 0 and elems >= FP8_GROUP else 1


def fp8_segment_bytes(elems: int) -> int:
    """Wire bytes of one segment of ``elems`` elements: scales, then one byte per element."""
    return groups_of(elems) * FP8_SCALE_BYTES + elems


def encode(x: torch.Tensor, out: torch.Tensor) -> None:
    """Quantize ``x`` (``(outer, n, elems)``, any float dtype, any device) into the uint8 ``out``
    (``(outer, n, fp8_segment_bytes(elems))``, host or same device), in the wire's segment format.

    Few passes over memory, in ``x``'s own dtype (the prefill engine's core does this while the
    link waits): one pass for the groups' largest magnitudes, one multiply, one conversion
    straight into ``out``. The scale on the wire is the exact inverse of the factor used, so the
    decoder undoes the multiply up to its own dtype's rounding.

    ``out`` on another device than ``x`` (an accelerator cache staged into host memory): the
    segments are built on ``x``'s device and cross as plain bytes. Converting across the devices
    and dtypes in one copy (bf16 on the GPU into an fp8 view of host memory) took twice as long on
    an H200 (benchmarks/wire_conversion_cost.py, docs/socket-connector.md)."""
    if out.device != x.device:
        built = torch.empty(out.shape, dtype=torch.uint8, device=x.device)
        encode(x, built)
        out.copy_(built)
        return
    outer, n, elems = x.shape
    g = groups_of(elems)
    xg = x.reshape(outer, n, g, elems // g)
    amax = xg.abs().amax(dim=-1, keepdim=True).float()
    factor = torch.where(amax > 0, FP8_TARGET / amax, torch.ones_like(amax))
    if float(factor.max()) > torch.finfo(x.dtype).max:   # tiny groups (fp16's range): multiply in float32
        xg = xg.float()
    factor = factor.to(xg.dtype)
    scale = 1.0 / factor.float()                 # what the decoder multiplies by: the factor's exact inverse
    out[:, :, : g * FP8_SCALE_BYTES].copy_(scale.view(torch.uint8).reshape(outer, n, g * FP8_SCALE_BYTES))
    # .view, never .reshape: a copy would be written instead of ``out``
    fp8 = out[:, :, g * FP8_SCALE_BYTES :].view(_FP8).view(outer, n, g, elems // g)
    fp8.copy_(xg * factor)


#: e4m3 code c, read as bfloat16 bits ``(c & 0x7f) << 4 | (c & 0x80) << 8``, is its value times 2^-120
#: (normal and subnormal codes alike: both formats' exponent fields line up at that offset)
_BF16_FROM_E4M3 = 2.0 ** 120


def e4m3_to_bf16_scaled(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``codes`` (uint8 e4m3 bytes, any shape) times ``scale`` (broadcastable, float32) as bfloat16,
    by integer bit moves and one multiply: about 5x faster than ``codes.view(e4m3).to(bf16)`` on
    a CPU core. The two NaN codes (never encoded from finite values) become +-480. Relies on
    bfloat16 subnormals (torch's default; under ``torch.set_flush_denormal(True)`` values below
    2^-6 of their group's scale would read as 0)."""
    bits = codes.to(torch.int16)
    sign = (bits & 0x80) << 8
    bits &= 0x7F
    bits <<= 4
    bits |= sign
    values = bits.view(torch.bfloat16)
    if float(scale.max()) < 2.0 ** 7:           # scale x 2^120 stays below bfloat16's largest (2^128)
        values.mul_((scale * _BF16_FROM_E4M3).to(torch.bfloat16))
    else:
        values.mul_(_BF16_FROM_E4M3)
        values.mul_(scale.to(torch.bfloat16))
    return values


def check_scales(wire: torch.Tensor, elems: int) -> None:
    """Raise :class:`~.wire.WireError` when any scale in ``wire`` (uint8 ``(outer, n, segment
    bytes)``, as :func:`encode` wrote it) is NaN or infinite: :func:`encode` only writes finite
    ones, and a non-finite scale would put NaN or inf into the decode engine's cache.

    Called by :meth:`Fp8Store._verify` on every received message before any of it is written:
    the fetch or stream then fails like one cut short (``client.PeerConnections`` turns the
    error into a ``FetchError``, the worker counts it in ``num_failed_transfers`` and vLLM
    recomputes the prompt)."""
    g = groups_of(elems)
    scale = wire[:, :, : g * FP8_SCALE_BYTES].contiguous().view(torch.float32)
    finite = torch.isfinite(scale)
    if not bool(finite.all()):
        bad = int(finite.numel() - int(finite.sum()))
        raise WireError(f"fp8 message with {bad} of {finite.numel()} scales NaN or infinite: refused, "
                        "nothing of it written")


def decode(wire: torch.Tensor, elems: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The ``(outer, n, elems)`` tensor of ``dtype`` on ``device`` that ``wire`` (uint8, as
    :func:`encode` wrote it) holds. Takes the scales as they come: :func:`check_scales` them first."""
    outer, n, _ = wire.shape
    g = groups_of(elems)
    wire = wire.to(device)                    # host staging -> accelerator: plain bytes, converted there
    scale = wire[:, :, : g * FP8_SCALE_BYTES].contiguous().view(torch.float32).reshape(outer, n, g, 1)
    codes = wire[:, :, g * FP8_SCALE_BYTES :].reshape(outer, n, g, elems // g)
    if dtype == torch.bfloat16 and codes.device.type == "cpu":
        return e4m3_to_bf16_scaled(codes, scale).reshape(outer, n, elems)
    values = codes.view(_FP8).float()          # float32: a scale beyond fp16's range still applies
    values.mul_(scale)
    return values.to(dtype).reshape(outer, n, elems)


class Fp8Store(StagedStore):
    """Any KV cache (host or device) with fp8 on the wire: quantized into host staging buffers
    when read (prefill side), dequantized into the cache when written (decode side).

    Built by :func:`.layout.make_store` for ``wire_format: fp8``; the listener (server.py) and
    the fetches (client.py) use it like any :class:`~.layout.BlockStore`. Each thread gets its
    own staging buffers, so parallel streams never share one.
    """

    def __init__(self, layout: KVLayout, views: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype]):
        """``layout``/``views``: :func:`.layout.describe` of the cache; ``dtypes``: each layer's element type."""
        bad = sorted({str(d) for d in dtypes if d not in FP8_SOURCES})
        if bad:
            raise LayoutError(f"wire_format fp8 needs a bf16, fp16 or fp32 KV cache, not {', '.join(bad)}")
        typed: list[torch.Tensor] = []
        layers: list[LayerLayout] = []
        for layer, view, dtype in zip(layout.layers, views, dtypes, strict=True):
            size = torch.tensor([], dtype=dtype).element_size()
            if layer.seg_bytes % size:
                raise LayoutError(f"layer {layer.name}: a segment of {layer.seg_bytes} bytes is not whole "
                                  f"{dtype} elements")
            typed.append(view.view(dtype))      # (outer, num_blocks, elems): the cache itself, no copy
            layers.append(LayerLayout(layer.name, layer.outer, layer.num_blocks,
                                      fp8_segment_bytes(typed[-1].shape[2])))
        super().__init__(KVLayout(tuple(layers), wire="fp8"), typed,
                         pin=any(t.device.type == "cuda" for t in typed))

    def _pack(self, blocks: torch.Tensor, host: torch.Tensor) -> None:
        encode(blocks, host)

    def _unpack(self, host: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return decode(host, like.shape[2], like.dtype, like.device)

    def _verify(self, host: torch.Tensor, like: torch.Tensor) -> None:
        check_scales(host, like.shape[2])
