"""The fixed cost of a KV handoff: the extra TTFT of a split over a plain prefill, per connector.

Brings up a 1P1D topology on this machine (the embedded model, one pinned
core per engine, ``routing: {policy: split}``) with ``disagg up --detach``,
and sends, one at a time and in rotating order, three streamed requests per
repeat and prompt length (each with a prompt of its own, so no prefix cache
helps):

- ``split``: through the proxy (prefill engine -> KV over the link -> decode engine);
- ``on P``: straight to the prefill engine, a plain request (what ``whole`` does);
- ``on D``: straight to the decode engine, a plain request (what ``local`` does).

The handoff's cost is ``TTFT(split) - TTFT(on P)`` (the prefill is the same
work on the same engine; what is left is two HTTP hops, the prefill engine's
reply, the KV transfer, the decode engine's scheduling of a remote prefill and
its first step), fitted by least squares as a fixed part plus a part per
prompt token over every prompt length and repeat.
That is the figure ``disagg plan`` and the proxy's routing seed use per
connector (:data:`disagg.routecost.HANDOFF_FIXED_S`). Takes the engine lock
(``/tmp/disagg-engines.lock``) so that no more than two engines run at once.

    .venv/bin/python benchmarks/handoff_fixed_cost.py --connector nixl [--prompt-tokens 64,256,1024]
        [--repeats 5] [--model tiny] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from disagg.kvmath import resolve_model
from disagg.planning import LINK_CLASSES
from disagg.prompts import exact_prompt, load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: harness
from harness.local_1p1d import local_1p1d, streamed_ttft


def _ttft(url: str, body: dict[str, object], key: str | None) -> tuple[float, int]:
    """(seconds to the first token event, prompt tokens) of one streamed completion at ``url``."""
    ttft, usage = streamed_ttft(url + "/v1/completions", body, key)
    return ttft, int(usage.get("prompt_tokens", 0))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connector", choices=("nixl", "socket"), default="nixl")
    parser.add_argument("--model", default="tiny", help="embedded model (tiny, tiny-kvheavy)")
    parser.add_argument("--prompt-tokens", default="64,256,1024")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write the raw rows and the result here")
    args = parser.parse_args()
    lengths = [int(t) for t in args.prompt_tokens.split(",")]
    engine_args = '["-O0", "--max-num-seqs", "8"]'
    with local_1p1d("fixed", connector=args.connector, model=args.model, engine_args=engine_args) as pair:
        topo, key = pair.topology, pair.engine_key
        targets = {"split": (pair.proxy_url, None), "on P": (pair.engine_urls["prefill[0]"], key),
                   "on D": (pair.engine_urls["decode[0]"], key)}
        tokenizer = load_tokenizer(Path(topo.model.path))
        arch = resolve_model(topo.model.source, local_path=topo.model.path)
        link_bps = LINK_CLASSES["loopback"].usable_bps
        for i in range(3):  # warm-up: first requests compile and allocate
            for name, (url, k) in targets.items():
                _ttft(url, {"model": "m", "prompt": exact_prompt(tokenizer, 256, f"w{i}{name}"),
                            "max_tokens": 2, "temperature": 0}, k)
        rows = []
        for rep in range(args.repeats):
            for n in lengths:
                order = list(targets)[rep % 3:] + list(targets)[:rep % 3]
                got = {}
                for name in order:
                    url, k = targets[name]
                    body = {"model": "m", "prompt": exact_prompt(tokenizer, n, f"r{rep}-{n}-{name}"),
                            "max_tokens": 2, "temperature": 0}
                    got[name], tokens = _ttft(url, body, k)
                kv_s = arch.kv_bytes(tokens, "bfloat16") * 8 / link_bps
                rows.append({"tokens": tokens, **got, "kv_s": kv_s,
                             "fixed": got["split"] - got["on P"] - kv_s})
    print(f"# handoff fixed cost: {args.connector}, embedded {args.model}, loopback, "
          f"load average {os.getloadavg()[0]:.2f}\n")
    print("| prompt tokens | TTFT split | TTFT on P | TTFT on D | split - on P - KV/link |")
    print("|---:|---:|---:|---:|---:|")
    for n in lengths:
        sel = [r for r in rows if abs(r["tokens"] - n) <= 2]
        med = {k: statistics.median(r[k] for r in sel) * 1e3 for k in ("split", "on P", "on D", "fixed")}
        print(f"| {n} | {med['split']:.1f} ms | {med['on P']:.1f} ms | {med['on D']:.1f} ms | {med['fixed']:.1f} ms |")
    fixed, per_token = fit_extra(rows)
    print(f"\nextra TTFT of a split over a plain prefill on P ({args.connector}), least squares over "
          f"{len(rows)} requests: {fixed * 1e3:.1f} ms fixed + {per_token * 1e6:.1f} us per prompt token "
          f"({args.repeats} repeats per length, one at a time, max_tokens 2)")
    if args.json:
        args.json.write_text(json.dumps({"connector": args.connector, "model": args.model, "rows": rows,
                                         "fixed_s": fixed, "extra_s_per_token": per_token,
                                         "loadavg": os.getloadavg()}, indent=2))
    return 0


def fit_extra(rows: list[dict]) -> tuple[float, float]:
    """``split - on P = fixed + per_token x tokens`` by least squares: (fixed s, s per token).

    What grows with the prompt beyond the link's own KV/link time (a connector
    slower than the link, a slower decode step) lands in the per-token part.
    """
    xs = [r["tokens"] for r in rows]
    ys = [r["split"] - r["on P"] for r in rows]
    slope, intercept = statistics.linear_regression(xs, ys)
    return intercept, slope


if __name__ == "__main__":
    raise SystemExit(main())
