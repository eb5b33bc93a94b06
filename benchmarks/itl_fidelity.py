"""Does the client see the decode engine's token rhythm? Client-side inter-token gaps vs the engine's own.

Brings up a 1P1D topology on this machine (the embedded model, one pinned core
per engine, ``routing: {policy: split}``) with ``disagg up --detach`` and sends,
per run, ``--requests`` sequential streamed completions (own prompt each,
``ignore_eos``) twice: through the proxy, and straight to the decode engine.
For each it reports the client's inter-token gap p50 and mean (the time between
successive token events of one answer) beside the decode engine's own
``vllm:inter_token_latency_seconds`` over the same requests (the delta of its
sum / count: the engine core's step timestamps, untouched by how fast its API
server forwards them). A ratio near 1 means the client's TPOT is faithful; a p50
far below the engine's means tokens reached the client in bursts.

Holds the engine lock (``/tmp/disagg-engines.lock``) while engines run.

    .venv/bin/python benchmarks/itl_fidelity.py [--connector nixl|socket] [--runs 3] [--requests 30]
        [--env-decode K=V ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from disagg.prometheus_text import sample_sum
from disagg.prompts import exact_prompt, load_tokenizer
from disagg.sse import SSEParser

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: harness
from harness.local_1p1d import local_1p1d

ITL = "vllm:inter_token_latency_seconds"


async def _stream_arrivals(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                       key: str | None) -> list[float]:
    """Arrival times (perf_counter seconds) of the token events of one streamed completion."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    arrivals: list[float] = []
    parser = SSEParser()
    async with session.post(url + "/v1/completions", json={**body, "stream": True}, headers=headers) as resp:
        resp.raise_for_status()
        async for chunk in resp.content.iter_any():
            now = time.perf_counter()
            for event in parser.feed(chunk):
                if event.done:
                    continue
                if event.json().get("choices"):   # a token chunk, its text may be empty (vllm bench's rule)
                    arrivals.append(now)
    return arrivals


async def _engine_itl(session: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    return sample_sum(text, ITL + "_sum"), sample_sum(text, ITL + "_count")


async def _measure(target: str, decode_url: str, key: str | None, tokenizer: Any, requests: int,
                   prompt_tokens: int, max_tokens: int, tag: str) -> dict[str, float]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        s0, c0 = await _engine_itl(session, decode_url)
        gaps: list[float] = []
        tpots: list[float] = []
        for i in range(requests):
            body = {"model": "m", "prompt": exact_prompt(tokenizer, prompt_tokens, f"{tag}-{i}"),
                    "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            arrivals = await _stream_arrivals(session, target, body, key)
            gaps += [b - a for a, b in itertools.pairwise(arrivals)]
            tpots.append((arrivals[-1] - arrivals[0]) / (max_tokens - 1))
        s1, c1 = await _engine_itl(session, decode_url)
    engine_mean = (s1 - s0) / max(c1 - c0, 1.0)
    p50 = statistics.median(gaps)
    return {"client_p50_ms": p50 * 1e3, "client_mean_ms": statistics.fmean(gaps) * 1e3,
            "client_p10_ms": float(statistics.quantiles(gaps, n=10)[0]) * 1e3,
            "client_tpot_ms": statistics.fmean(tpots) * 1e3, "events": len(gaps) + requests,
            "engine_mean_ms": engine_mean * 1e3, "engine_tokens": c1 - c0, "gaps": len(gaps),
            "ratio_p50": p50 / engine_mean if engine_mean else float("nan")}


def _engine_core_pids() -> list[int]:
    """The vLLM engine-core processes running now (their process title is ``VLLM::EngineCore``)."""
    pids = []
    for proc in psutil.process_iter(["name", "cmdline"]):
        title = " ".join(proc.info.get("cmdline") or []) + " " + (proc.info.get("name") or "")
        if "EngineCore" in title:
            pids.append(proc.pid)
    return pids


def _set_core_nice(value: int) -> None:
    """Nice value of each engine core's main thread only (Linux niceness is per thread): the thread
    that runs the model steps; its ZMQ I/O threads, which hand tokens to the API server, keep theirs."""
    for pid in _engine_core_pids():
        os.setpriority(os.PRIO_PROCESS, pid, value)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connector", choices=("nixl", "socket"), default="nixl")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--engine-args", default='["-O0"]', help="JSON list of extra engine arguments")
    parser.add_argument("--env-decode", action="append", default=[], metavar="K=V",
                        help="extra environment of the decode engine (repeatable)")
    parser.add_argument("--engine-core-nice", type=int, default=None,
                        help="A/B: alternate runs with the engine cores' main threads at this nice value "
                             "and at 0 (lowering needs no privilege; restoring 0 needs root)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    env_d = dict(kv.split("=", 1) for kv in args.env_decode)
    results: list[dict[str, Any]] = []
    with local_1p1d("itl", connector=args.connector, engine_args=args.engine_args, decode_env=env_d) as pair:
        topo, key = pair.topology, pair.engine_key
        decode_url = pair.engine_urls["decode[0]"]
        targets = {"proxy": (pair.proxy_url, None), "decode": (decode_url, key)}
        tokenizer = load_tokenizer(Path(topo.model.path))
        for name, (url, k) in targets.items():  # warm-up
            asyncio.run(_measure(url, decode_url, k, tokenizer, 3, args.prompt_tokens, 8, f"w-{name}"))
        variants = [0] if args.engine_core_nice is None else [0, args.engine_core_nice]
        for run, nice in itertools.product(range(args.runs), variants):
            _set_core_nice(nice)
            for name, (url, k) in targets.items():
                row = asyncio.run(_measure(url, decode_url, k, tokenizer, args.requests, args.prompt_tokens,
                                           args.max_tokens, f"r{run}-{nice}-{name}"))
                row.update(run=run + 1, target=name, loadavg=os.getloadavg()[0], core_nice=nice)
                results.append(row)
                print(f"run {run + 1} nice {nice} {name:6s}: client gap p50 {row['client_p50_ms']:.3f} ms "
                      f"(p10 {row['client_p10_ms']:.3f}, mean {row['client_mean_ms']:.3f}), TPOT "
                      f"{row['client_tpot_ms']:.3f}, {row['events']} events; engine ITL mean "
                      f"{row['engine_mean_ms']:.3f} ms over {row['engine_tokens']:.0f} tokens, "
                      f"ratio {row['ratio_p50']:.2f}, load {row['loadavg']:.2f}", flush=True)
    for nice in sorted({r["core_nice"] for r in results}):
        rows = [r for r in results if r["core_nice"] == nice]
        within = sum(1 for r in rows if abs(r["ratio_p50"] - 1) <= 0.2)
        print(f"\nengine core nice {nice}: {within}/{len(rows)} (run, target) pairs with client gap p50 "
              f"within 20% of the engine's ITL mean (env of decode: {env_d or 'default'}, "
              f"engine args {args.engine_args})")
    if args.json:
        args.json.write_text(json.dumps({"env_decode": env_d, "rows": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
