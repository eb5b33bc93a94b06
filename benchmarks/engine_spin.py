"""A split's TTFT and the engines' CPU after it, topology by topology: what vLLM's queue readers' busy-wait costs.

vLLM's queue readers busy-wait for 1 s after each message (connectors/engine_spin.py, which
``disagg up`` turns on for CPU engines, says so and what it does instead). To see what that costs,
give this script a 1P1D topology twice, once as it is and once with ``env: {DISAGG_ENGINE_SPIN_S:
"1"}`` on both instances (vLLM's own spin). For each topology, one after the other under the
engine lock, it brings up a copy with ``routing: {policy: split}`` (``disagg up --detach``),
warms it up, and then, for each pause (``--pauses``):

- sends ``-n`` streamed prompts of ``--tokens`` tokens (each its own prompt: no prefix cache)
  through the proxy one at a time, each ``pause`` seconds after the last one ended, and records
  their TTFT;
- after one more such split, the CPU seconds each engine's processes (API server, engine core,
  worker) use in the ``--watch`` seconds after its answer, against the same engines' CPU over as
  long a time idle (measured after a 3 s rest).

It prints one table, a row per topology and pause (TTFT p50, min-max; CPU after a split and
idle, per engine) and the load average; ``--json`` keeps the rows. Run it alone, as root when a
topology emulates its link (the namespace):

    .venv/bin/python benchmarks/engine_spin.py /tmp/ab/house-spin-poll.yaml /tmp/ab/house-spin-vllm.yaml \\
        --tokens 256 --output 4 --pauses 0.2,3 -n 7
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: harness
from disagg.engines.vllm import served_model_name
from disagg.prompts import exact_prompt, load_tokenizer
from harness.engines import process_trees
from harness.local_1p1d import Running1P1D, deployed, streamed_ttft

#: the rest before the idle CPU is measured (seconds): longer than vLLM's 1 s spin
REST_S = 3.0


def cpu_s(pid: int) -> float:
    """CPU seconds used so far by the engine whose leader is ``pid`` and every process under it."""
    total = 0.0
    for proc in process_trees([pid]):
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def cpu_over(run: Running1P1D, seconds: float) -> dict[str, float]:
    """Each engine's CPU seconds over the next ``seconds``."""
    before = {name: cpu_s(pid) for name, pid in run.engine_pids.items()}
    time.sleep(seconds)
    return {name: cpu_s(pid) - before[name] for name, pid in run.engine_pids.items()}


def split_copy(topology: Path, work: Path) -> Path:
    """A copy of ``topology`` under ``work`` with every prompt split (its run directory is the one
    :func:`measure` passes to ``disagg up --run-dir``)."""
    spec = yaml.safe_load(topology.read_text())
    spec["routing"] = {**(spec.get("routing") or {}), "policy": "split"}
    copy = work / topology.name
    copy.write_text(yaml.safe_dump(spec, sort_keys=False))
    return copy


def measure(topology: Path, work: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Bring up a split copy of ``topology`` and measure every pause (module doc)."""
    copy = split_copy(topology, work)
    rows = []
    with deployed(copy, work / f"run-{topology.stem}") as run:
        tokenizer = load_tokenizer(Path(run.topology.model.path))
        model = served_model_name(run.topology)
        url = run.proxy_url + "/v1/completions"

        def split(tag: str) -> float:
            body = {"model": model, "prompt": exact_prompt(tokenizer, args.tokens, tag),
                    "max_tokens": args.output, "temperature": 0, "ignore_eos": True}
            return streamed_ttft(url, body)[0]

        for i in range(3):                      # warm-up: first requests compile and allocate
            split(f"warm-{topology.stem}-{i}")
        for pause in args.pauses:
            ttfts = []
            for i in range(args.n):
                time.sleep(pause)
                ttfts.append(split(f"{topology.stem}-{pause}-{i}"))
            time.sleep(pause)
            split(f"{topology.stem}-{pause}-cpu")
            after = cpu_over(run, args.watch)
            time.sleep(REST_S)
            idle = cpu_over(run, args.watch)
            rows.append({"topology": topology.stem, "pause_s": pause, "ttft_s": ttfts,
                         "cpu_after_split_s": after, "cpu_idle_s": idle})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("topologies", nargs="+", type=Path, help="1P1D topology files, run in order")
    parser.add_argument("--tokens", type=int, default=256, help="prompt tokens (default 256)")
    parser.add_argument("--output", type=int, default=4, help="answer tokens (default 4)")
    parser.add_argument("--pauses", default="0.2,3", help="seconds between an answer and the next prompt")
    parser.add_argument("-n", type=int, default=7, help="splits per pause (default 7)")
    parser.add_argument("--watch", type=float, default=2.0, help="seconds of CPU watched after a split")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    args.pauses = [float(p) for p in args.pauses.split(",")]
    work = Path(tempfile.mkdtemp(prefix="disagg-engine-spin-"))
    started = os.getloadavg()[0]
    rows = [row for topology in args.topologies for row in measure(topology, work, args)]
    print(f"# split TTFT and engine CPU: {args.tokens}-token prompts, {args.output} answer tokens, "
          f"{args.n} per pause; load average {started:.2f} at the start, {os.getloadavg()[0]:.2f} at the end\n")
    print(f"| topology | pause | TTFT p50 | TTFT min-max | CPU s in {args.watch:g} s after a split | idle |")
    print("|---|---:|---:|---:|---|---|")
    for r in rows:
        ms = sorted(t * 1e3 for t in r["ttft_s"])
        after = ", ".join(f"{k} {v:.2f}" for k, v in r["cpu_after_split_s"].items())
        idle = ", ".join(f"{k} {v:.2f}" for k, v in r["cpu_idle_s"].items())
        print(f"| {r['topology']} | {r['pause_s']:g} s | {statistics.median(ms):.0f} ms | "
              f"{ms[0]:.0f}-{ms[-1]:.0f} ms | {after} | {idle} |")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "loadavg": os.getloadavg(), "args": {
            "tokens": args.tokens, "output": args.output, "n": args.n, "watch": args.watch}}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
