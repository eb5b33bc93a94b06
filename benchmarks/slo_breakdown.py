"""Why the requests of each run missed the SLO, beside the paths ``auto`` took in that run.

Reads a ``disagg bench compare`` report directory (``results.json``, and the proxy
logs it kept when the topologies ran with ``proxy.log_level: debug``) and prints,
per topology, rate and repeat, a Markdown row: requests that met the SLO, how many
missed each limit (TTFT, TPOT, E2EL; a request may miss several) or failed, the
median TPOT, and for an ``auto`` run the share of its routing decisions per path
(``local`` / ``split`` / ``whole``, decisions logged while the run sent its
requests) with the handoffs in transit on the link at each decision (median and
maximum; logs of proxies older than that field show none). Goodput says how
many requests were good; this says which limit the others crossed and what the
policy was doing meanwhile, e.g. that a 1P1D misses on TPOT while one decode
engine decodes nearly every request.

    .venv/bin/python benchmarks/slo_breakdown.py REPORT_DIR [REPORT_DIR ...] [--slo ttft=2s,tpot=30ms]

``--slo`` scores the same requests against another objective than the one the report was run
with (a configuration whose routing took no SLO as input serves the same requests whatever the
objective; ``auto`` with an SLO must be run with it).

The definitions are the report's own (:mod:`disagg.bench.metrics`): TTFT to the
first token chunk, TPOT over the tokens after the first, a failed request
counted apart.
"""

from __future__ import annotations

import argparse
import re
import statistics
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from disagg.bench.compare import kept_proxy_log
from disagg.bench.metrics import missed_limits, tpot
from disagg.bench.records import RequestRecord
from disagg.bench.report import load_json
from disagg.bench.slo import SLO, parse_slo

#: one routing decision of the router's debug log: when, path, and (newer proxies) handoffs in transit
DECISION = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+) \S+ DEBUG route \S+: \d+ tokens, [\d.]+ out -> (\w+) "
                      r"\(\w+\).*?(?:; handoffs .*? (\d+) in transit)?$")
#: decisions this long before a run's start still count as its own (the log's and the client's clocks)
EARLY = timedelta(seconds=1)
PATHS = ("local", "split", "whole")


@dataclass(frozen=True)
class Decision:
    at: datetime
    path: str
    in_transit: int | None


@dataclass(frozen=True)
class RunBreakdown:
    label: str
    rate: str
    repeat: int
    requests: int
    good: int
    missed: Mapping[str, int]         # per SLO limit (ttft, tpot, e2el), and "failed"
    tpot_p50_s: float | None
    paths: Mapping[str, int]          # auto's decisions per path during the run (empty: none logged)
    in_transit: tuple[int, ...]       # handoffs in transit at each decision that logged it


def parse_decisions(lines: Iterable[str]) -> list[Decision]:
    """The routing decisions of a proxy's debug log, their times read as this machine's local time
    (the proxy logs in local time; the report's start times carry their offset)."""
    out = []
    for line in lines:
        if m := DECISION.match(line):
            at = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").astimezone()
            out.append(Decision(at, m.group(2), int(m.group(3)) if m.group(3) else None))
    return out


def breakdown(label: str, run: Mapping[str, Any], slo: SLO, decisions: Sequence[Decision]) -> RunBreakdown:
    """One run's requests against ``slo``, and the decisions logged while it sent them."""
    missed: Counter[str] = Counter()
    good = 0
    tpots = []
    for rec in (RequestRecord.from_dict(r) for r in run["records"]):
        ttft, e2el = rec.ttft, rec.e2el
        if not rec.success or ttft is None or e2el is None:
            missed["failed"] += 1
            continue
        per_token = tpot(e2el, ttft, rec.output_tokens)
        if per_token is not None:
            tpots.append(per_token)
        crossed = missed_limits(slo, ttft, per_token, e2el)
        missed.update(crossed)
        good += not crossed
    start = datetime.fromisoformat(run["started_at"])
    end = start + timedelta(seconds=float(run["duration_s"]))
    mine = [d for d in decisions if start - EARLY <= d.at <= end]
    transit = tuple(d.in_transit for d in mine if d.in_transit is not None)
    return RunBreakdown(label, str(run["label"]), int(run.get("repeat", 0)), len(run["records"]), good,
                        dict(missed), statistics.median(tpots) if tpots else None,
                        dict(Counter(d.path for d in mine)), transit)


def _proxy_log(report_dir: Path, label: str, result: Mapping[str, Any]) -> Path | None:
    kept = result.get("proxy_log")
    candidates = [Path(kept)] if kept else []
    candidates.append(kept_proxy_log(report_dir, label))
    return next((p for p in candidates if p.is_file()), None)


def read_report(report_dir: Path, rescore: SLO | None = None) -> list[RunBreakdown]:
    """Every run of the report in ``report_dir``, against its own SLO or ``rescore``."""
    doc = load_json(report_dir / "results.json")
    rows: list[RunBreakdown] = []
    for label, result in doc.items():
        s = result.get("slo") or {}
        slo = rescore or SLO(s.get("ttft"), s.get("tpot"), s.get("e2el"))
        log = _proxy_log(report_dir, label, result)
        decisions = parse_decisions(log.read_text(errors="replace").splitlines()) if log is not None else []
        rows.extend(breakdown(label, run, slo, decisions) for run in result["runs"])
    return rows


def row(b: RunBreakdown) -> str:
    """The run's Markdown row."""
    missed = " / ".join(str(b.missed.get(k, 0)) for k in ("ttft", "tpot", "e2el", "failed"))
    tpot_ms = f"{b.tpot_p50_s * 1e3:.0f}" if b.tpot_p50_s is not None else "-"
    n = sum(b.paths.values())
    paths = " / ".join(f"{100 * b.paths.get(p, 0) / n:.0f}" for p in PATHS) if n else "-"
    transit = f"{statistics.median(b.in_transit):g} / {max(b.in_transit)}" if b.in_transit else "-"
    return (f"| {b.label} | {b.rate} | {b.repeat} | {b.good} / {b.requests} | {missed} | {tpot_ms} | {paths} "
            f"| {transit} |")


HEADER = ("| run | load | repeat | met SLO | missed TTFT / TPOT / E2EL / failed | TPOT p50 ms "
          "| local / split / whole % | handoffs in transit p50 / max |\n|---|---|---:|---:|---|---:|---|---|")


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reports", nargs="+", type=Path, help="report directories of disagg bench compare")
    ap.add_argument("--slo", help="score against this SLO (e.g. ttft=2s,tpot=30ms) instead of each report's own")
    args = ap.parse_args(argv)
    print(HEADER)
    rescore = parse_slo(args.slo) if args.slo else None
    for report in args.reports:
        for b in read_report(report, rescore):
            print(row(b))


if __name__ == "__main__":
    main()
