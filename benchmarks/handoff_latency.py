"""Startup time of a 1P1D pair and the KV handoff per prompt length.

Brings a topology up with `disagg up --detach`, sends streaming
completions of exact prompt lengths through the proxy (one at a time), and
reads, per request, the proxy's prefill and handoff timings and the decode
engine's NIXL counters (bytes, transfer seconds). Takes the topology down at
the end, whatever happens.

    .venv/bin/python benchmarks/handoff_latency.py [--topology topologies/local-cpu-nixl.yaml]
        [--prompt-tokens 128,512,1500,3000] [--repeats 3]

Prints a Markdown table (medians over the repeats); docs/launcher.md has the
figures measured on the project's machines.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from disagg.deployment import build_deployment
from disagg.engines.vllm import served_model_name
from disagg.launch.state import load_state, run_path
from disagg.prometheus_text import sample_sum
from disagg.prompts import exact_prompt, load_tokenizer
from disagg.topology import load_topology

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: harness
from harness.local_1p1d import streamed_ttft


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=60) as resp:
        return resp.read().decode()


def _measure(proxy: str, decode: str, body: dict) -> dict[str, float]:
    p0, d0 = _get(proxy + "/metrics"), _get(decode + "/metrics")
    t0 = time.perf_counter()
    ttft, usage = streamed_ttft(proxy + "/v1/completions", body)
    wall = time.perf_counter() - t0
    p1, d1 = _get(proxy + "/metrics"), _get(decode + "/metrics")

    def delta(before: str, after: str, name: str) -> float:
        return sample_sum(after, name) - sample_sum(before, name)

    return {"tokens": usage["prompt_tokens"], "wall": wall, "ttft": ttft,
            "prefill": delta(p0, p1, "disagg_proxy_prefill_seconds_sum"),
            "handoff": delta(p0, p1, "disagg_proxy_handoff_seconds_sum"),
            "xfer": delta(d0, d1, "vllm:nixl_xfer_time_seconds_sum"),
            "bytes": delta(d0, d1, "vllm:nixl_bytes_transferred_sum")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topology", default="topologies/local-cpu-nixl.yaml")
    parser.add_argument("--prompt-tokens", default="128,512,1500,3000")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    topo = load_topology(args.topology)
    dep = build_deployment(topo)
    if topo.colocated:
        parser.error("needs a disaggregated topology (prefill + decode)")
    started = time.perf_counter()
    up = subprocess.run([sys.executable, "-m", "disagg", "up", args.topology, "--detach"], text=True,
                        capture_output=True)
    startup = time.perf_counter() - started
    if up.returncode != 0:
        print(up.stdout + up.stderr, file=sys.stderr)
        return 1
    try:
        state = load_state(run_path(topo.run_dir, topo.name) / "state.json")
        decode = next(r.url for r in state.processes if r.name == "decode[0]")
        tokenizer = load_tokenizer(Path(topo.model.path))
        healthy = [line for line in up.stdout.splitlines() if "healthy after" in line]
        print(f"# handoff latency: {topo.name} ({topo.connector} over {topo.link.type})\n")
        print(f"`disagg up --detach` returned after {startup:.0f} s; " + "; ".join(healthy) + "\n")
        print("| prompt tokens | KV bytes moved | prefill (proxy) | handoff: P reply -> first D token (proxy) "
              "| NIXL transfer (decode engine) | TTFT (client) | request (client) |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for n, tokens in enumerate(int(t) for t in args.prompt_tokens.split(",")):
            rows = []
            for rep in range(args.repeats):
                body = {"model": served_model_name(topo), "prompt": exact_prompt(tokenizer, tokens, f"h{n}-{rep}"),
                        "max_tokens": 8, "temperature": 0}
                rows.append(_measure(dep.proxy_url, decode, body))

            def med(key: str, rows: list[dict[str, float]] = rows) -> float:
                return statistics.median(r[key] for r in rows)

            print(f"| {tokens} | {med('bytes') / 1024:.0f} KiB | {med('prefill') * 1e3:.0f} ms "
                  f"| {med('handoff') * 1e3:.0f} ms | {med('xfer') * 1e3:.1f} ms | {med('ttft') * 1e3:.0f} ms "
                  f"| {med('wall') * 1e3:.0f} ms |")
        print(f"\nmedians of {args.repeats} requests each, one at a time, max_tokens 8")
    finally:
        subprocess.run([sys.executable, "-m", "disagg", "down", args.topology], capture_output=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
