"""Replay a proxy's local-route decisions through its own predictor, offline.

A proxy started with ``proxy.log_level: debug`` (topology) or ``--log-level
debug`` logs one line per routing decision (prompt tokens, path) and one per
prompt's first token (observed and predicted TTFT). This script feeds the
``local`` ones, in log order, through :class:`disagg.proxy.measure.Measurements`
as the proxy does (dispatch at the decision, settle and sample at the first
token) and prints the mean absolute relative error of the predictions per
prompt class, next to the error the logged predictions had. Change the
predictor, run it again on the same log: a check in seconds, without engines.

The replay sees one decode engine and local routes only (a split's prefill
reply time is not logged), seeds the fit with ``--seed-rate`` tokens/s, and
uses the decision time as the send time. The decode engine's requests in flight
come from each decision's line, as the proxy counted them: the busy line (what
load adds) is replayed too.

    .venv/bin/python benchmarks/route_replay.py .disagg/runs/NAME/logs/proxy.log [--short-below 500]
"""

from __future__ import annotations

import argparse
import re
import statistics
from datetime import datetime
from pathlib import Path

from prediction_floor import DECISION, ENGINE  # a sibling script: benchmarks/ is on sys.path

from disagg.proxy.measure import Measurements

DECIDED = re.compile(r"(\d\d:\d\d:\d\d,\d+) disagg-proxy DEBUG route (\S+): (\d+) tokens(?:, [\d.]+ out)? -> (\w+)")
FIRST = re.compile(r"(\d\d:\d\d:\d\d,\d+) disagg-proxy DEBUG route (\S+): (\w+), (\d+) tokens: "
                   r"first token after ([\d.]+) ms, predicted ([\d.]+) ms")


def seconds(stamp: str) -> float:
    t = datetime.strptime(stamp, "%H:%M:%S,%f")
    return t.hour * 3600 + t.minute * 60 + t.second + t.microsecond / 1e6


#: (time, decide|first, request id, tokens, the decode engine's requests in flight for decide,
#: (observed s, logged prediction s) for first)
Event = tuple[float, str, str, int, int, tuple[float, float] | None]


def decode_in_flight(line: str) -> int:
    """The decision's decode engine's requests in flight, from its decision line (0 where the
    line does not print them: logs written before it did)."""
    m = DECISION.search(line)
    if m is None:
        return 0
    engines = {url or role: int(n) for role, url, n, _queued in ENGINE.findall(m.group(4))}
    return engines.get(m.group(3), engines.get("decode", 0))


def events(log: Path) -> list[Event]:
    """The local routes' decisions and first tokens, in time order."""
    out: list[Event] = []
    for line in log.read_text().splitlines():
        if (m := DECIDED.search(line)) and m[4] == "local":
            out.append((seconds(m[1]), "decide", m[2], int(m[3]), decode_in_flight(line), None))
        elif (m := FIRST.search(line)) and m[3] == "local":
            out.append((seconds(m[1]), "first", m[2], int(m[4]), 0, (float(m[5]) / 1e3, float(m[6]) / 1e3)))
    out.sort(key=lambda e: e[0])
    return out


def replay(evts: list[Event], seed_rate: float) -> list[tuple[int, float, float, float]]:
    """(tokens, observed, replayed prediction, logged prediction) per local prompt."""
    m = Measurements(prefill_tokens_per_s=seed_rate, decode_tokens_per_s=seed_rate, overhead_s=0.01,
                     handoff_fixed_s=0.016, link_bytes_per_s=1e9)
    sent: dict[str, tuple[object, float, float, int]] = {}
    out = []
    for t, kind, rid, tokens, in_flight, seen in evts:
        if kind == "decide":
            predicted = m.engine_cost("decode", "d", in_flight, now=t).ttft_s(tokens)
            queued = m.queued_tokens("decode", "d", t)
            sent[rid] = (m.dispatch("decode", "d", tokens, now=t), queued, predicted, in_flight)
        elif rid in sent and seen is not None:
            pending, queued, predicted, in_flight = sent.pop(rid)
            m.settle("decode", "d", pending, now=t)  # type: ignore[arg-type]
            m.observe_prefill("decode", "d", tokens, seen[0], queued, in_flight=in_flight)
            out.append((tokens, seen[0], predicted, seen[1]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", type=Path, help="a proxy log written at log level debug")
    ap.add_argument("--short-below", type=int, default=500, help="prompts shorter than this are 'short'")
    ap.add_argument("--seed-rate", type=float, default=3000.0, help="the fit's seed, tokens/s")
    args = ap.parse_args()
    rows = replay(events(args.log), args.seed_rate)
    if not rows:
        raise SystemExit(f"{args.log}: no local route with a first token (was the proxy at log level debug?)")

    def mae(sel: list[tuple[int, float, float, float]], col: int) -> str:
        return f"{statistics.mean(abs(r[col] - r[1]) / r[1] for r in sel):.0%}" if sel else "-"

    for name, sel in (("short", [r for r in rows if r[0] < args.short_below]),
                      ("long", [r for r in rows if r[0] >= args.short_below]), ("all", rows)):
        print(f"local {name:5s} {len(sel):4d} prompts: replayed MAE {mae(sel, 2):>5s}, logged MAE {mae(sel, 3):>5s}")


if __name__ == "__main__":
    main()
