"""How far the proxy's per-prompt TTFT predictions are from the floor a machine sets.

Reads a proxy log written with ``log_level: debug`` (one line per routing
decision, one per prompt's first token: :mod:`disagg.proxy.router`) and groups
the prompts by path, prompt class (nearest of ``--classes``), the load of the
engine that computed the prompt (the decode engine for ``local``, the prefill
engine for ``split`` and ``whole``) when it was chosen: its requests in flight
(0, 1, 2, 3 or more) and whether it had prefill work queued. For each group it prints the
proxy's mean absolute relative error and an oracle's: the one constant that
minimises the group's error afterwards. The oracle knows every outcome of the
group and nothing the policy does not see (path, prompt length, load), so its
error is noise a predictor of that kind cannot remove: the floor under the
``auto`` policy's 25 % target (docs/results.md).

    .venv/bin/python benchmarks/prediction_floor.py .disagg/runs/NAME/logs/proxy.log --classes 64,512
    .venv/bin/python benchmarks/prediction_floor.py OUT/logs/NAME-auto-proxy.log   # kept by bench compare
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

#: the router's decision line (request ids are the client's X-Request-Id: anything but blanks)
DECISION = re.compile(r"route (\S+): \d+ tokens, [\d.]+ out -> \w+ \(\w+\) P=(\S+) D=(\S+); .*; tpot and engines (.*)$")
FIRST_TOKEN = re.compile(r"route (\S+): (\w+), (\d+) tokens: first token after ([\d.]+) ms, predicted ([\d.]+) ms")
#: one engine of the decision line (a rate the fit has not bounded prints as ``inf``); logs written
#: before the line named each engine's URL name only its role (one engine per role)
ENGINE = re.compile(r"(prefill|decode) (?:(\S+) )?(\d+) in flight [^(]*\((?:prefill duty \d+%, )?"
                    r"line [\d.]+ ms \+ n / (?:[\d.]+|inf)/s, queued (\d+), busy")
#: which engine of the decision (P= or D=) computed the prompt on each path
COMPUTING = {"local": "decode", "whole": "prefill", "split": "prefill"}
#: a group needs this many prompts to be scored
MIN_GROUP = 4


@dataclass(frozen=True)
class Prompt:
    path: str
    tokens: int
    observed_ms: float
    predicted_ms: float
    in_flight: int
    queued: bool


def parse(lines: Iterable[str]) -> list[Prompt]:
    """The prompts whose decision and first token are both in the log."""
    loads: dict[str, dict[str, tuple[int, bool]]] = {}
    out = []
    for line in lines:
        if m := DECISION.search(line):
            engines = {url or role: (int(n), int(q) > 0) for role, url, n, q in ENGINE.findall(m.group(4))}
            loads[m.group(1)] = {role: engines[url if url in engines else role]
                                 for role, url in (("prefill", m.group(2)), ("decode", m.group(3)))
                                 if url in engines or role in engines}
        elif (m := FIRST_TOKEN.search(line)) and m.group(2) in COMPUTING:
            load = loads.get(m.group(1), {}).get(COMPUTING[m.group(2)])
            if load is not None and float(m.group(4)) > 0:
                out.append(Prompt(m.group(2), int(m.group(3)), float(m.group(4)), float(m.group(5)), *load))
    return out


def mae(pairs: list[tuple[float, float]]) -> float:
    """Mean of |predicted - observed| / observed over ``(observed, predicted)`` pairs."""
    return statistics.fmean(abs(p - o) / o for o, p in pairs)


def oracle_mae(observed: list[float]) -> float:
    """The smallest mean relative error one constant reaches on ``observed``: the constant is a
    weighted median (weights 1 / observed), so trying every observed value finds it."""
    return min(mae([(o, c) for o in observed]) for c in observed)


def report(prompts: list[Prompt], classes: list[int]) -> str:
    groups: dict[tuple[str, int, int, bool], list[Prompt]] = defaultdict(list)
    for p in prompts:
        cls = min(classes, key=lambda c: abs(c - p.tokens))
        groups[(p.path, cls, min(p.in_flight, 3), p.queued)].append(p)
    rows = ["| path | class | in flight | queued | prompts | proxy MAE | oracle MAE | TTFT p10 / p50 / p90 ms |",
            "|---|---:|---|---|---:|---:|---:|---|"]
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for (path, cls, load, queued), group in sorted(groups.items()):
        if len(group) < MIN_GROUP:
            continue
        observed = [p.observed_ms for p in group]
        own, floor = mae([(p.observed_ms, p.predicted_ms) for p in group]), oracle_mae(observed)
        deciles = statistics.quantiles(observed, n=10, method="inclusive")
        rows.append(f"| {path} | {cls} | {'3+' if load == 3 else load} | {'yes' if queued else 'no'} | {len(group)} "
                    f"| {100 * own:.0f}% | {100 * floor:.0f}% | {deciles[0]:.0f} / {statistics.median(observed):.0f}"
                    f" / {deciles[-1]:.0f} |")
        total = totals[path]
        total[0] += len(group)
        total[1] += own * len(group)
        total[2] += floor * len(group)
    rows += ["", "| path | prompts scored | proxy MAE | oracle MAE |", "|---|---:|---:|---:|"]
    rows += [f"| {path} | {n:.0f} | {100 * own / n:.0f}% | {100 * floor / n:.0f}% |"
             for path, (n, own, floor) in sorted(totals.items())]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log", help="a proxy log written with log_level: debug")
    ap.add_argument("--classes", default="64,512", help="prompt classes in tokens, comma-separated")
    args = ap.parse_args(argv)
    with open(args.log, encoding="utf-8") as f:
        prompts = parse(f)
    if not prompts:
        print(f"{args.log}: no routing decisions with first tokens (was the proxy at log_level debug?)",
              file=sys.stderr)
        return 1
    print(report(prompts, [int(c) for c in args.classes.split(",")]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
