"""What the socket connector's staging and fp8 conversion cost on the device that holds the KV cache.

A GPU engine's KV leaves device memory through pinned host staging buffers, and with
``wire_format: fp8`` it is quantized on the device on the way (prefill side) and dequantized on
the device on the way back in (decode side). This times exactly the connector's own code for
that (``make_store`` and its ``reading`` / ``writing``, chunk by chunk and layer by layer as the
listener and the fetch do), with no network: a Llama-3.1-8B-shaped cache (32 layers, 8 KV heads
of 128, bf16, vLLM's FlashAttention layout ``(2, num_blocks, 16, 8, 128)`` per layer) holding
random values, for each prompt length and wire format. It prints, per row, the prefill side's
staging time (device -> host, quantizing for fp8), the decode side's (host -> device,
dequantizing), the bytes on the wire, and what the wire itself takes at 1, 2.5 and 10 Gb/s used
at 94 %, so the conversions can be set against the link they are meant to save time on.

Runs on any torch device (``--device cpu`` times the host-cache path the CPU engines use, where
the conversions run on the engine's own cores); median of ``--repeats`` after one warm-up.

    python benchmarks/wire_conversion_cost.py --device cuda --tokens 512,2048,8000
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from disagg_connectors.socket_connector.layout import make_store
from disagg_connectors.socket_connector.server import chunks
from disagg_connectors.socket_connector.wireformat import default_blocks_per_message

#: Llama-3.1-8B's KV shape
LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
LINKS_GBIT = (1.0, 2.5, 10.0)
LINK_EFFICIENCY = 0.94


def caches(tokens: int, device: str) -> tuple[dict[str, torch.Tensor], int]:
    blocks = -(-tokens // BLOCK) + 8
    gen = torch.Generator(device=device).manual_seed(0)
    out = {f"model.layers.{i:02d}.self_attn.attn":
           torch.randn(2, blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen, device=device).to(torch.bfloat16)
           for i in range(LAYERS)}
    return out, blocks


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def timed(fn, device: str, repeats: int) -> float:
    fn()                                     # warm-up: staging buffers grown, kernels loaded
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def row(tokens: int, wire: str, device: str, repeats: int) -> dict[str, float]:
    src, blocks = caches(tokens, device)
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    p_store, d_store = make_store(src, blocks, wire), make_store(dst, blocks, wire)
    ids = list(range(-(-tokens // BLOCK)))
    per_msg = default_blocks_per_message(p_store.layout)

    def send() -> None:           # the listener's loop, without the socket
        for part in chunks(ids, per_msg):
            for layers in p_store.message_layers():
                with p_store.reading(part, layers):
                    pass

    def receive() -> None:        # the fetch's loop, without the socket
        for part in chunks(ids, per_msg):
            for layers in d_store.message_layers():
                with d_store.writing(part, layers):
                    pass

    return {"tokens": tokens, "kv_mb": len(ids) * sum(t[:, 0].numel() * 2 for t in src.values()) / 1e6,
            "wire_mb": len(ids) * p_store.layout.block_bytes / 1e6,
            "send_ms": timed(send, device, repeats) * 1e3, "receive_ms": timed(receive, device, repeats) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", default="512,2048,8000")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "host"
    print(f"# device {args.device} ({name}), torch {torch.__version__}, Llama-3.1-8B KV shape, bf16 cache, "
          f"median of {args.repeats}")
    links = " | ".join(f"wire @{g:g} Gb/s ms" for g in LINKS_GBIT)
    print(f"| tokens | format | KV MB | wire MB | P staging ms | D staging ms | {links} |")
    print("|---:|---|---:|---:|---:|---:|" + "---:|" * len(LINKS_GBIT))
    for tokens in (int(t) for t in args.tokens.split(",")):
        for wire in ("raw", "fp8"):
            r = row(tokens, wire, args.device, args.repeats)
            link = " | ".join(f"{r['wire_mb'] * 8 / (g * LINK_EFFICIENCY):.1f}" for g in LINKS_GBIT)
            print(f"| {tokens} | {wire} | {r['kv_mb']:.1f} | {r['wire_mb']:.1f} | {r['send_ms']:.2f} | "
                  f"{r['receive_ms']:.2f} | {link} |", flush=True)


if __name__ == "__main__":
    main()
