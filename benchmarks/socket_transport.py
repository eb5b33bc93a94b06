"""Raw throughput of the socket connector's transport, no engines.

A server process holds a KV cache of ``--mib`` MiB (CPU layout, bf16) and
leases all of it; the client process fetches it into its own cache with 1, 2
and 4 streams over loopback (or ``--host``). This is the ceiling the connector
can reach inside vLLM on this machine (measured here: one Python TCP
stream over loopback moved 4.3-5.2 GB/s).

    .venv/bin/python benchmarks/socket_transport.py --mib 256
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys

import torch
from disagg_connectors.socket_connector.client import FetchOptions, FetchPlan, fetch
from disagg_connectors.socket_connector.layout import make_store
from disagg_connectors.socket_connector.leases import LeaseTable
from disagg_connectors.socket_connector.server import KVServer

SECRET = b"benchmark-secret-0123456789abcdef"
BLOCK_TOKENS, HEADS, HEAD = 128, 8, 128  # tiny-kvheavy per layer: 512 KiB per block
LAYERS = 8


def caches(num_blocks: int) -> dict[str, torch.Tensor]:
    return {f"layers.{i}": torch.ones(num_blocks, HEADS, BLOCK_TOKENS, 2 * HEAD, dtype=torch.bfloat16)
            for i in range(LAYERS)}


def serve(num_blocks: int, host: str, ready: mp.Queue, stop: mp.Event) -> None:
    leases = LeaseTable()
    server = KVServer(make_store(caches(num_blocks), num_blocks), leases, SECRET, host, 0)
    server.start()
    for i in range(100):
        leases.register(f"r{i}", list(range(num_blocks)), 600)
    ready.put(server.port)
    stop.wait()
    server.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--streams", default="1,2,4")
    args = ap.parse_args(argv)
    block_bytes = LAYERS * HEADS * BLOCK_TOKENS * 2 * HEAD * 2
    num_blocks = max(1, args.mib * 2**20 // block_bytes)
    ready: mp.Queue = mp.Queue()
    stop = mp.Event()
    proc = mp.Process(target=serve, args=(num_blocks, args.host, ready, stop))
    proc.start()
    try:
        port = ready.get(timeout=60)
        store = make_store(caches(num_blocks), num_blocks)
        ids = list(range(num_blocks))
        req = 0
        print("| streams | MiB | median s | GB/s |\n|---:|---:|---:|---:|")
        for streams in (int(s) for s in args.streams.split(",")):
            times = []
            for _ in range(args.repeats):
                res = fetch(FetchPlan(args.host, port, f"r{req}", ids, ids), SECRET, store,
                            FetchOptions(streams=streams))
                req += 1
                times.append(res.seconds)
            t = statistics.median(times)
            print(f"| {streams} | {num_blocks * block_bytes / 2**20:.0f} | {t:.3f} | "
                  f"{num_blocks * block_bytes / t / 1e9:.2f} |", flush=True)
    finally:
        stop.set()
        proc.join(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
