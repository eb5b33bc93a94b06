"""The ``auto`` routing policy's targets, checked on a ``disagg bench compare --routing auto,split`` report.

Reads ``results.json`` (medians over each step's repeats) and prints, per
connector and request rate, a Markdown table of each target with the figure,
the bound and whether it is met (and by how much it is missed):

1. ``auto`` goodput >= the best of the replica pool and static ``split``, minus 5%;
2. where static ``split`` saturates (it completes fewer than ``--saturated`` x
   the offered rate in requests per second), ``auto`` goodput >= 1.5 x ``split``'s
   (no verdict, ``-``, when that bound is above the offered rate and not met: no
   run can reach it, e.g. split at 6.1 good requests/s of 8 offered);
3. ``auto``'s short-class TTFT p50 within 1.2 x the replica pool's;
4. below saturation (``auto`` completes at least ``--saturated`` x the offered
   rate), the proxy's predicted TTFT within 25% of the observed, per path (mean
   over prompts of |predicted - observed| / observed, from the proxy's
   ``disagg_route_ttft_error_ratio``; paths with fewer than 5 prompts skipped).

    .venv/bin/python benchmarks/matrix_targets.py REPORT/results.json --replicas replicas \\
        --pair nixl=local-cpu-nixl --pair socket=local-cpu [--short-class short] [--summary]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from disagg.bench.metrics import metrics_by_class
from disagg.bench.records import RequestRecord
from disagg.bench.report import load_json, metric_value, step_groups
from disagg.bench.routes import merge_deltas, route_summary
from disagg.bench.slo import parse_slo

MIN_PROMPTS = 5


def _median(group: list[Mapping[str, Any]], klass: str, *keys: str) -> float | None:
    """The median over a step's repeats of ``metrics[klass][keys...]`` (the report's reading of a value)."""
    values = [v for run in group if klass in run["metrics"]
              and (v := metric_value(run["metrics"][klass], keys)) is not None]
    return statistics.median(values) if values else None


def _steps(result: Mapping[str, Any]) -> dict[float, list[Mapping[str, Any]]]:
    return {float(g[0]["rate"]): g for g in step_groups(result) if g[0].get("rate") not in (None, "inf")}


def _row(rate: float, target: str, value: str, bound: str, met: bool | None, note: str = "") -> str:
    verdict = "-" if met is None else ("met" if met else "MISSED")
    return f"| {rate:g} | {target} | {value} | {bound} | {verdict} | {note} |"


def check(doc: Mapping[str, Any], replicas: str, auto: str, split: str, short: str, saturated: float) -> list[str]:
    """The table rows for one connector's pair of labels (``auto``, ``split``) against ``replicas``.
    A report without ``split`` runs (``--routing auto`` alone) is checked against the replicas
    alone: the bound says so, and the 1.5 x split target is not checked."""
    rep, aut = _steps(doc[replicas]), _steps(doc[auto])
    spl = _steps(doc[split]) if split in doc else None
    rows = []
    for rate in sorted(set(aut) & set(rep) & (set(spl) if spl is not None else set(aut))):
        g_auto, g_rep = (_median(s[rate], "all", "goodput") for s in (aut, rep))
        g_split = _median(spl[rate], "all", "goodput") if spl is not None else None
        if g_auto is None or g_rep is None or (spl is not None and g_split is None):
            continue
        best = max(g_split or 0.0, g_rep)
        against = f"replicas {g_rep:.2f}, " + (f"split {g_split:.2f}" if g_split is not None else "split not run")
        rows.append(_row(rate, "goodput >= best(replicas, split) - 5%", f"{g_auto:.2f}",
                         f"{0.95 * best:.2f} ({against})", g_auto >= 0.95 * best,
                         "" if g_auto >= 0.95 * best else f"short by {100 * (1 - g_auto / (0.95 * best)):.0f}%"))
        done_auto = _median(aut[rate], "all", "request_throughput")
        done_split = _median(spl[rate], "all", "request_throughput") if spl is not None else None
        if g_split is not None and done_split is not None and done_split < saturated * rate:
            ok: bool | None = g_auto >= 1.5 * g_split
            note = "" if ok else f"{g_auto / g_split:.2f} x split"
            if 1.5 * g_split > rate and not ok:
                ok, note = None, f"{g_auto / g_split:.2f} x split; the bound exceeds the offered {rate:g} req/s"
            rows.append(_row(rate, "split saturated: goodput >= 1.5 x split", f"{g_auto:.2f}",
                             f"{1.5 * g_split:.2f}", ok, note))
        t_auto, t_rep = _median(aut[rate], short, "ttft", "median_ms"), _median(rep[rate], short, "ttft", "median_ms")
        if t_auto is not None and t_rep is not None:
            ok = t_auto <= 1.2 * t_rep
            rows.append(_row(rate, f"{short} TTFT p50 <= 1.2 x replicas", f"{t_auto:.1f} ms",
                             f"{1.2 * t_rep:.1f} ms (replicas {t_rep:.1f})", ok,
                             "" if ok else f"{t_auto / t_rep:.2f} x replicas"))
        merged = merge_deltas(run.get("routes") for run in aut[rate])
        if merged is None:
            continue
        below = done_auto is not None and done_auto >= saturated * rate
        for path, s in route_summary(merged).items():
            mae = s.get("mean_abs_error")
            if mae is None or s["prompts"] < MIN_PROMPTS:
                continue
            rows.append(_row(rate, f"{path}: predicted TTFT within 25% (MAE)", f"{100 * mae:.0f}%", "25%",
                             mae <= 0.25 if below else None,
                             f"{s['prompts']:g} prompts, mean predicted {s['predicted_ttft_ms']:.0f} / observed "
                             f"{s['observed_ttft_ms']:.0f} ms" + ("" if below else "; saturated: not a target")))
    return rows


def summary(doc: Mapping[str, Any], short: str, long: str) -> list[str]:
    """One row per (label, rate): medians over the repeats, goodput with its min-max, failures, route mix."""
    rows = ["| topology | rate req/s | goodput req/s (min-max) | SLO met | TTFT p50 short / long ms | "
            "TPOT p50 ms | failed | route mix |", "|---|---:|---|---:|---|---:|---:|---|"]
    for label, result in doc.items():
        for rate, group in sorted(_steps(result).items()):
            goodputs = [float(run["metrics"]["all"]["goodput"]) for run in group]
            g = statistics.median(goodputs)
            slo = _median(group, "all", "slo_attainment")
            ts, tl = _median(group, short, "ttft", "median_ms"), _median(group, long, "ttft", "median_ms")
            tpot = _median(group, "all", "tpot", "median_ms")
            failed = sum(int(run["metrics"]["all"]["failed"]) for run in group)
            merged = merge_deltas(run.get("routes") for run in group)
            mix = "-"
            if merged is not None:
                mix = ", ".join(f"{path} {100 * s['share']:.0f}%" for path, s in route_summary(merged).items()
                                if s["share"])
            rows.append(f"| {label} | {rate:g} | {g:.2f} ({min(goodputs):.2f}-{max(goodputs):.2f}) | "
                        f"{'-' if slo is None else f'{100 * slo:.0f}%'} | "
                        f"{'-' if ts is None else f'{ts:.0f}'} / {'-' if tl is None else f'{tl:.0f}'} | "
                        f"{'-' if tpot is None else f'{tpot:.1f}'} | {failed} | {mix} |")
    return rows


def with_slo(doc: dict[str, Any], text: str) -> None:
    """Recompute every run's metrics from its records under another SLO (``ttft=1s,tpot=50ms``), in place."""
    slo = parse_slo(text)
    for result in doc.values():
        result["slo"] = slo.to_dict()
        for run in result["runs"]:
            records = [RequestRecord.from_dict(r) for r in run["records"]]
            run["metrics"] = {k: m.to_dict() for k, m in metrics_by_class(records, run["duration_s"], slo).items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--replicas", default="replicas", help="label of the replica pool")
    parser.add_argument("--pair", action="append", default=[], metavar="NAME=LABEL",
                        help="a split topology's label; its runs are LABEL[auto] and LABEL[split]")
    parser.add_argument("--short-class", default="short")
    parser.add_argument("--long-class", default="long")
    parser.add_argument("--slo", help="recompute goodput from the records under this SLO (e.g. ttft=1s,tpot=50ms)")
    parser.add_argument("--summary", action="store_true", help="first print one row per topology and rate")
    parser.add_argument("--saturated", type=float, default=0.9,
                        help="completing fewer requests per second than this fraction of the offered rate "
                             "counts as saturated (0.9)")
    args = parser.parse_args()
    doc = load_json(args.results)
    if args.slo:
        with_slo(doc, args.slo)
    if args.summary:
        print("\n".join(summary(doc, args.short_class, args.long_class)))
    for pair in args.pair:
        name, _, label = pair.partition("=")
        split = f"{label}[split]" if f"{label}[split]" in doc else "no split runs"
        print(f"\n### {name}: {label}[auto] against {args.replicas} ({split})\n")
        print("| rate req/s | target | auto | bound | verdict | note |\n|---|---|---|---|---|---|")
        for line in check(doc, args.replicas, f"{label}[auto]", f"{label}[split]", args.short_class,
                          args.saturated):
            print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
