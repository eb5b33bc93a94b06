"""Would a lossless wire format pay? Ratio and one-thread speed of general-purpose codecs on a KV cache.

Computes the KV cache of one prompt through an embedded model with transformers
(no engine: the same bf16 K and V the engine stores), then compresses the raw
bytes with zstd (levels 1 and 3) and lz4, each also after a byte shuffle (all
high bytes of the 16-bit values, then all low bytes: the exponents sit in the
high bytes), one thread, best of 3. Prints the ratio, compress and decompress
MB/s (of cache bytes; the shuffle's own time not counted), and what a handoff of
that cache would take if compression, the link and decompression overlapped
message by message: ``max(wire / link, raw / compress, raw / decompress)``
against ``raw / link``, at 1 and 2.5 Gb/s usable at 94 %.

Needs ``zstandard`` and ``lz4`` (not project dependencies: ``pip install
zstandard lz4`` into the venv that runs it). Takes no engine lock (no engine),
but measure on a quiet machine.

    .venv/bin/python benchmarks/lossless_kv.py [--model tiny-kvheavy] [--tokens 2048]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch

from disagg.modelgen import ensure_model

LINK_EFFICIENCY = 0.94


def kv_bytes(model_dir: Path, tokens: int) -> bytes:
    """The bf16 K and V of every layer for a ``tokens``-token prompt, as the raw bytes of the tensors."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16)
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    ids = tok(text * (1 + tokens // 500), return_tensors="pt").input_ids[:, :tokens]
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    return b"".join(t.contiguous().view(torch.int16).numpy().tobytes() for t in tensors)


def byte_shuffle(raw: bytes) -> bytes:
    """All high bytes of the 16-bit values, then all low bytes."""
    pairs = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(-1, 2)
    return pairs.t().contiguous().numpy().tobytes()


def best_of(fn: Callable[[], bytes], repeats: int = 3) -> tuple[bytes, float]:
    """(the result, the fastest of ``repeats`` runs in seconds)."""
    best, out = float("inf"), b""
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return out, best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-kvheavy", help="embedded model (default tiny-kvheavy)")
    ap.add_argument("--tokens", type=int, default=2048)
    args = ap.parse_args()
    import lz4.frame
    import zstandard

    raw = kv_bytes(ensure_model(args.model, Path(".disagg/models") / args.model), args.tokens)
    shuffled = byte_shuffle(raw)
    mb = len(raw) / 1e6
    print(f"{args.model}: {args.tokens} tokens, {mb:.1f} MB of bf16 KV cache")
    codecs: dict[str, tuple[Callable[[bytes], bytes], Callable[[bytes], bytes]]] = {
        "lz4": (lambda b: lz4.frame.compress(b, compression_level=0), lz4.frame.decompress)}
    for level in (1, 3):
        comp, dec = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()
        codecs[f"zstd-{level}"] = (comp.compress, dec.decompress)
    rows = []
    for name, (compress, decompress) in codecs.items():
        for shuffle, data in (("", raw), ("+shuffle", shuffled)):
            packed, tc = best_of(lambda data=data, compress=compress: compress(data))
            _, td = best_of(lambda packed=packed, decompress=decompress: decompress(packed))
            rows.append((name + shuffle, len(packed) / len(raw), mb / tc, mb / td))
    print(f"{'codec':16s} {'ratio':>6s} {'compress MB/s':>14s} {'decompress MB/s':>16s}  "
          "handoff vs raw at 1 / 2.5 Gb/s")
    for name, ratio, c, d in rows:
        shares = []
        for gbit in (1.0, 2.5):
            link = gbit * 1e3 * LINK_EFFICIENCY / 8           # MB/s
            shares.append(max(mb * ratio / link, mb / c, mb / d) / (mb / link))
        print(f"{name:16s} {ratio:6.3f} {c:14.0f} {d:16.0f}  {shares[0]:.0%} / {shares[1]:.0%}")


if __name__ == "__main__":
    main()
