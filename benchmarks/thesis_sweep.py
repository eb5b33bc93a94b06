"""Where the thesis would hold: ``disagg plan``'s workload model swept over the house's factors.

The thesis target on the emulated house (``topologies/house-emulated.yaml``): ``auto`` reaches at
least 1.2 x the goodput of the best of {colocated on the gamer, colocated on the workstation, the
replica pool of both} at one or more rates, for long prompts under a TPOT-tight SLO. Measured on
the 2-core box it is not met robustly (decode time binds: one KV-bound CPU core decodes every split
request). This tool asks the workload model (:mod:`disagg.workload_plan`) where it would be met.

It starts from the house's engines as ``disagg plan`` builds them (:func:`plan_workload` on the
topology, with the measurements stored in its ``run_dir`` or ``--run-dir``; ``--connector`` as
``benchmarks/emulated_house.py`` replaces it). Where a host's prefill speed is emulated and no rate
was measured (``plan`` refuses to price it), it starts from the model's own estimates for the file
instead, and says so: the spec-sheet estimate for every host, then the decode host's stated
``emulate.prefill_rate`` for its prefill. From there it scales four factors (:class:`Point`):

- **compute ratio**: the prefill host's prefill rate over the decode host's, at 2,048 tokens; the
  prefill host's (the gamer's) prefill times are scaled, the decode host's kept;
- **decode memory rate**: the decode host's (the workstation's) decode step, both its fixed part
  and its part per byte of KV, divided by the factor (what more memory bandwidth would change; the
  handoff's first step on that host with it, where it is priced);
- **KV memory**: the prefill host's KV capacity, per engine;
- **link**: the line rate between them (usable: 94% of it, as the nominal table takes TCP).

For each workload (default ``short=256:256@0.5,long=2048:256@0.5`` and ``long=2048:256``), SLO
(default ``ttft=2471ms,tpot=31ms``, the house's TPOT-tight one) and rate, it predicts the goodput of
colocated on either host, the replica pool, the static split and ``auto`` (the prefill host
prefilling; :func:`goodput`, ``predict`` without its saturation search), and per grid point and
split kind the rate where its goodput over the best of the other three is highest
(:func:`verdict`: only rates where it serves at least ``--min-goodput``), the ratio and the margin.
It prints one row per grid point, then for each factor value how many points hold (``--json``: all).

    .venv/bin/python benchmarks/thesis_sweep.py [--run-dir DIR] [--connector socket] [--json]

(``DIR``: the run directory ``benchmarks/emulated_house.py`` gave the ratio, whose probes stored
the measurements.) Pure arithmetic, no engines; the default grid (192 points, 2 workloads, 9
rates) takes about 30 s. The model's limits are ``disagg plan``'s (docs/the-one-question.md): its
``auto`` is the router without an SLO input, and on the house its TTFT p50 was off by a median ~29%.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from disagg.bench.slo import SLO, parse_slo
from disagg.bench.workload import PromptClass, parse_classes
from disagg.errors import DisaggError, PlanError
from disagg.planning import TCP_EFFICIENCY, LinkEstimate, PrefillEstimate
from disagg.routecost import DecodeLine
from disagg.topology import Topology, parse_size, parse_topology
from disagg.units import fmt_bytes
from disagg.workload_plan import (
    AUTO,
    COLOCATED,
    REPLICAS,
    SPLIT,
    EngineModel,
    Layout,
    Mix,
    WorkloadPlan,
    evaluate,
    goodput_rps,
    plan_workload,
    predict_classes,
    routes_for,
)

ROOT = Path(__file__).resolve().parent.parent
HOUSE = ROOT / "topologies" / "house-emulated.yaml"
WORKLOADS = ("short=256:256@0.5,long=2048:256@0.5", "long=2048:256")
SLO_TEXT = "ttft=2471ms,tpot=31ms"
RATES = (0.1, 0.25, 0.35, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0)
#: the thesis target: this many times the best of the others' goodput
THRESHOLD = 1.2
#: a split kind's goodput below this (req/s) at a rate is not counted there (a ratio of near-zeros)
MIN_GOODPUT = 0.05
#: a rival serving less than this (req/s) serves nothing (its ratio would be a division by near-zero)
NIL_RPS = 1e-3
#: the prompt length a compute ratio is stated at (as ``disagg plan`` prints prefill rates)
RATIO_TOKENS = 2048
#: the default grid; None: the house's own value
COMPUTE = (2.0, None, 12.0, 24.0)
MEMORY = (1.0, 2.0, 4.0, 8.0)
KV = (96.0 * 2**20, None, 768.0 * 2**20)
LINK = (0.5, 1.0, None, 10.0)

#: the four factors, as :func:`tally` and the table name them
FACTORS = ("compute", "memory", "kv", "link")
#: the five configurations, by their short names; the first three are the rivals
PREFILL_ALONE, DECODE_ALONE, POOL = "prefill-alone", "decode-alone", "pool"
CONFIGS = (PREFILL_ALONE, DECODE_ALONE, POOL, SPLIT, AUTO)
RIVALS = (PREFILL_ALONE, DECODE_ALONE, POOL)


# --- the factors ---------------------------------------------------------------------

def scale_prefill(p: PrefillEstimate, speed: float) -> PrefillEstimate:
    """``p`` at ``speed`` times its rate: every prompt's prefill takes ``1 / speed`` of its time."""
    if speed <= 0:
        raise ValueError(f"a prefill speed must be positive, got {speed}")
    return replace(p, tokens_per_s=None if p.tokens_per_s is None else p.tokens_per_s * speed,
                   flops_per_s=None if p.flops_per_s is None else p.flops_per_s * speed,
                   shape=None if p.shape is None else (p.shape[0] / speed, p.shape[1] / speed))


def scale_decode(d: DecodeLine, speed: float) -> DecodeLine:
    """``d`` on ``speed`` times the memory rate: its fixed part and its part per KV byte both divided."""
    if speed <= 0:
        raise ValueError(f"a decode speed must be positive, got {speed}")
    return replace(d, fixed_s=d.fixed_s / speed, per_kv_byte_s=d.per_kv_byte_s / speed)


def scale_first_step(link: LinkEstimate, speed: float) -> LinkEstimate:
    """``link`` with its decode host's first step at ``speed`` times the memory rate, where the plan
    priced it from that host (a measured fixed cost already holds the first step: left alone)."""
    if link.measured_fixed_s is not None:
        return replace(link, first_step_wire_bps=None if link.first_step_wire_bps is None
                       else link.first_step_wire_bps * speed)
    return replace(link, first_step_fixed_s=link.first_step_fixed_s / speed,
                   first_step_wire_bps=None if link.first_step_wire_bps is None else link.first_step_wire_bps * speed)


def with_line_rate(link: LinkEstimate, line_bps: float) -> LinkEstimate:
    """``link`` at a line rate of ``line_bps``: usable at :data:`TCP_EFFICIENCY` of it."""
    if line_bps <= 0:
        raise ValueError(f"a line rate must be positive, got {line_bps}")
    return replace(link, usable_bps=line_bps * TCP_EFFICIENCY, label=f"{line_bps / 1e9:g} Gb/s line rate (swept)")


def compute_ratio(prefill: PrefillEstimate, decode: PrefillEstimate) -> float:
    """How many times faster the prefill host prefills than the decode host, at :data:`RATIO_TOKENS`."""
    return prefill.rate(RATIO_TOKENS) / decode.rate(RATIO_TOKENS)


@dataclass(frozen=True)
class Point:
    """One grid point, in absolute figures: the compute ratio (prefill host over decode host), the
    decode host's memory rate as a multiple of the house's, the prefill host's KV capacity per
    engine (bytes) and the link's line rate (bits/s)."""

    compute_ratio: float
    memory_speed: float
    prefill_kv_bytes: float
    link_bps: float

    def to_json(self) -> dict[str, float]:
        """JSON-ready."""
        return {"compute_ratio": self.compute_ratio, "decode_memory_speed": self.memory_speed,
                "prefill_kv_bytes": self.prefill_kv_bytes, "link_bps": self.link_bps}


@dataclass(frozen=True)
class House:
    """The starting point: the five configurations as ``disagg plan`` builds them for the topology,
    the workloads' mixes, and where the figures come from."""

    prefill_host: str
    decode_host: str
    layouts: dict[str, Layout]          # by CONFIGS name
    mixes: tuple[tuple[Mix, ...], ...]  # per workload
    source: str                         # measured, or ESTIMATES (why)
    base: Point                         # the house's own factors

    def layout_at(self, config: str, point: Point) -> Layout:
        """``config``'s layout with ``point``'s factors applied."""
        lay = self.layouts[config]
        speed = point.compute_ratio / self.base.compute_ratio
        memory = point.memory_speed / self.base.memory_speed

        def engine(e: EngineModel) -> EngineModel:
            if e.host == self.prefill_host:
                return replace(e, prefill=scale_prefill(e.prefill, speed), kv_capacity_bytes=point.prefill_kv_bytes)
            if e.host == self.decode_host:
                return replace(e, decode=scale_decode(e.decode, memory))
            return e

        link = lay.link
        if link is not None:
            link = with_line_rate(scale_first_step(link, memory), point.link_bps)
        return replace(lay, both=tuple(map(engine, lay.both)), prefill=tuple(map(engine, lay.prefill)),
                       decode=tuple(map(engine, lay.decode)), link=link)


def depends_on(config: str, point: Point) -> tuple[float, ...]:
    """The factors of ``point`` that ``config``'s goodput depends on (the cache key)."""
    if config == PREFILL_ALONE:
        return (point.compute_ratio, point.prefill_kv_bytes)
    if config == DECODE_ALONE:
        return (point.memory_speed,)
    if config == POOL:
        return (point.compute_ratio, point.memory_speed, point.prefill_kv_bytes)
    return (point.compute_ratio, point.memory_speed, point.prefill_kv_bytes, point.link_bps)


# --- the model -----------------------------------------------------------------------

def goodput(layout: Layout, mix: Sequence[Mix], rate: float, slo: SLO) -> float:
    """Requests per second meeting ``slo`` when ``layout`` serves ``mix`` at ``rate``: what
    :func:`disagg.workload_plan.predict` gives as ``goodput_rps``, without its saturation search."""
    outcome = evaluate(mix, rate, routes_for(layout, mix, rate))
    return goodput_rps(mix, predict_classes(mix, outcome, slo), rate)


@dataclass(frozen=True)
class Verdict:
    """A split kind against the best of the rivals, at the rate where its ratio is highest."""

    config: str
    rate: float | None          # None: at no rate does it serve MIN_GOODPUT
    goodput: float
    rival: str | None           # the best rival there (None: every rival serves nothing)
    rival_goodput: float
    threshold: float
    holds_at: tuple[float, ...] = ()    # every rate where it serves MIN_GOODPUT and the target holds

    @property
    def ratio(self) -> float:
        """Its goodput over the best rival's (inf: the rivals serve nothing; nan: no rate)."""
        if self.rate is None:
            return math.nan
        return math.inf if self.rival_goodput <= 0 else self.goodput / self.rival_goodput

    @property
    def margin(self) -> float:
        """Its goodput less the best rival's, req/s."""
        return self.goodput - self.rival_goodput

    @property
    def holds(self) -> bool:
        """Whether the target holds at its best rate: at least ``threshold`` x the best rival."""
        return self.rate is not None and self.ratio >= self.threshold

    def to_json(self) -> dict[str, Any]:
        """JSON-ready (ratio None where the rivals serve nothing or no rate counts)."""
        return {"config": self.config, "rate": self.rate, "goodput_rps": self.goodput, "best_other": self.rival,
                "best_other_goodput_rps": self.rival_goodput,
                "ratio": self.ratio if math.isfinite(self.ratio) else None,
                "margin_rps": self.margin if self.rate is not None else None, "holds": self.holds,
                "holds_at_rates": list(self.holds_at)}


def best_rival(goodputs: dict[str, float], rivals: Sequence[str] = RIVALS) -> tuple[str | None, float]:
    """The rival with the most goodput (the first on a tie), or (None, 0) where none serves
    :data:`NIL_RPS`."""
    top = max(rivals, key=lambda r: goodputs[r])
    return (top, goodputs[top]) if goodputs[top] >= NIL_RPS else (None, 0.0)


def verdict(config: str, by_rate: dict[float, dict[str, float]], threshold: float = THRESHOLD,
            min_goodput: float = MIN_GOODPUT, rivals: Sequence[str] = RIVALS) -> Verdict:
    """``config`` against the best of ``rivals`` at each rate of ``by_rate`` (rate -> config ->
    goodput): the rate where its ratio is highest (where the rivals serve nothing, infinite; among
    those, its most goodput), counting only rates where it serves at least ``min_goodput``; ties
    go to the larger margin, then the lower rate. Its ``holds_at``: every counted rate where the
    ratio reaches ``threshold``."""
    best: tuple[tuple[float, float, float], Verdict] | None = None
    holds_at: list[float] = []
    for rate in sorted(by_rate):
        row = by_rate[rate]
        mine = row[config]
        if mine < min_goodput:
            continue
        rival, theirs = best_rival(row, rivals)
        v = Verdict(config, rate, mine, rival, theirs, threshold)
        if v.holds:
            holds_at.append(rate)
        key = (v.ratio if math.isfinite(v.ratio) else math.inf, v.margin, -rate)
        if best is None or key > best[0]:
            best = (key, v)
    if best is None:
        return Verdict(config, None, 0.0, None, 0.0, threshold)
    return replace(best[1], holds_at=tuple(holds_at))


# --- the house -----------------------------------------------------------------------

def _topology(path: Path, run_dir: str | None, connector: str | None, estimates: bool) -> tuple[Topology,
                                                                                                dict[str, float]]:
    """The topology at ``path`` with ``connector`` and ``run_dir`` replaced when given; with
    ``estimates``, without its hosts' emulated prefill speeds (so plan prices them from the spec
    sheet), which it returns beside it (host -> stated prefill_rate)."""
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict):
        raise PlanError(f"{path}: not a topology (a YAML mapping)")
    if connector is not None:
        data["connector"] = connector
    if run_dir is not None:
        data["run_dir"] = run_dir
    stated: dict[str, float] = {}
    if estimates:
        for name, host in (data.get("hosts") or {}).items():
            emulate = host.get("emulate") if isinstance(host, dict) else None
            if isinstance(emulate, dict):
                rate = emulate.pop("prefill_rate", None)
                emulate.pop("cpu_share", None)
                if rate is not None:
                    stated[str(name)] = float(rate)
    return parse_topology(yaml.safe_dump(data, sort_keys=False), str(path)), stated


def _pick(plan: WorkloadPlan, prefill_host: str, decode_host: str) -> dict[str, Layout]:
    """The five configurations of ``plan`` by their short names (splits with ``prefill_host`` prefilling)."""
    out: dict[str, Layout] = {}
    for c in plan.configs:
        lay = c.layout
        if lay.kind == COLOCATED:
            out[PREFILL_ALONE if lay.hosts == (prefill_host,) else DECODE_ALONE] = lay
        elif lay.kind == REPLICAS:
            out[POOL] = lay
        elif lay.kind in (SPLIT, AUTO) and tuple(dict.fromkeys(e.host for e in lay.prefill)) == (prefill_host,) \
                and tuple(dict.fromkeys(e.host for e in lay.decode)) == (decode_host,):
            out[lay.kind] = lay
    missing = [c for c in CONFIGS if c not in out]
    if missing:
        raise PlanError(f"{plan.topology}: the plan has no {', '.join(missing)} configuration (a two-host split "
                        "topology is needed)")
    return out


def load_house(path: Path, workloads: Sequence[Sequence[PromptClass]], slo: SLO, run_dir: str | None = None,
               connector: str | None = None) -> House:
    """The house's five configurations and the workloads' mixes, as ``disagg plan`` builds them from
    ``path``'s measurements; where plan refuses for want of a measured rate on an emulated host, from
    its estimates (every host's spec-sheet prefill estimate, the decode host's stated rate)."""
    topo, _ = _topology(path, run_dir, connector, estimates=False)
    prefill_host = topo.role("prefill")[0].host
    decode_host = topo.role("decode")[0].host
    stated: dict[str, float] = {}
    try:
        plans = [plan_workload(topo, w, 1.0, slo) for w in workloads]
        source = f"measured: the rates and steps stored in {topo.run_dir}"
    except PlanError:
        if not any(h.emulate is not None and h.emulate.prefill_rate is not None for h in topo.hosts.values()):
            raise
        topo, stated = _topology(path, run_dir, connector, estimates=True)
        plans = [plan_workload(topo, w, 1.0, slo) for w in workloads]
        source = (f"ESTIMATES, plan's own for this file (no prefill rate measured for its emulated hosts in "
                  f"{topo.run_dir}): spec-sheet prefill, decode steps as plan "
                  "estimates them, " + ", ".join(f"{h} prefilling at its stated {r:g} tokens/s"
                                                 for h, r in stated.items()))
    layouts = _pick(plans[0], prefill_host, decode_host)
    if stated:
        def fix(e: EngineModel) -> EngineModel:
            if e.host not in stated:
                return e
            return replace(e, prefill=PrefillEstimate(
                f"ESTIMATE: the stated emulate.prefill_rate {stated[e.host]:g} tokens/s", estimated=True,
                arch=e.prefill.arch, tokens_per_s=stated[e.host]))
        layouts = {k: replace(v, both=tuple(map(fix, v.both)), prefill=tuple(map(fix, v.prefill)),
                              decode=tuple(map(fix, v.decode))) for k, v in layouts.items()}
    p_alone, d_alone = layouts[PREFILL_ALONE].both[0], layouts[DECODE_ALONE].both[0]
    kv = p_alone.kv_capacity_bytes
    if kv is None:
        raise PlanError(f"{path}: hosts.{prefill_host}: its KV capacity is unknown, so it cannot be swept")
    link = layouts[SPLIT].link
    assert link is not None
    base = Point(compute_ratio(p_alone.prefill, d_alone.prefill), 1.0, kv, link.usable_bps / TCP_EFFICIENCY)
    return House(prefill_host, decode_host, layouts, tuple(p.mix for p in plans), source, base)


# --- the sweep -----------------------------------------------------------------------

@dataclass(frozen=True)
class Row:
    """One grid point of one workload: every configuration's goodput per rate, and the verdicts."""

    point: Point
    goodputs: dict[float, dict[str, float]]
    auto: Verdict
    split: Verdict

    def to_json(self) -> dict[str, Any]:
        """JSON-ready."""
        return {**self.point.to_json(), "goodput_rps": {str(r): g for r, g in self.goodputs.items()},
                "auto": self.auto.to_json(), "split": self.split.to_json()}


def grid(base: Point, compute: Iterable[float | None], memory: Iterable[float | None],
         kv: Iterable[float | None], link: Iterable[float | None]) -> list[Point]:
    """Every combination of the factors' values (None: the house's own), duplicates dropped."""
    out: list[Point] = []
    for c in compute:
        for m in memory:
            for k in kv:
                for b in link:
                    p = Point(base.compute_ratio if c is None else c, base.memory_speed if m is None else m,
                              base.prefill_kv_bytes if k is None else k, base.link_bps if b is None else b)
                    if p not in out:
                        out.append(p)
    return out


def sweep(house: House, points: Sequence[Point], rates: Sequence[float], slo: SLO, threshold: float = THRESHOLD,
          min_goodput: float = MIN_GOODPUT) -> list[list[Row]]:
    """Per workload of ``house``, one :class:`Row` per point (a rival's goodput is computed once for
    the factors it depends on)."""
    out: list[list[Row]] = []
    for w, mix in enumerate(house.mixes):
        cache: dict[tuple[Any, ...], float] = {}
        rows: list[Row] = []
        for point in points:
            by_rate: dict[float, dict[str, float]] = {}
            layouts = {c: house.layout_at(c, point) for c in CONFIGS}
            for rate in rates:
                row: dict[str, float] = {}
                for c in CONFIGS:
                    key = (w, c, depends_on(c, point), rate)
                    if key not in cache:
                        cache[key] = goodput(layouts[c], mix, rate, slo)
                    row[c] = cache[key]
                by_rate[rate] = row
            rows.append(Row(point, by_rate, verdict(AUTO, by_rate, threshold, min_goodput),
                            verdict(SPLIT, by_rate, threshold, min_goodput)))
        out.append(rows)
    return out


def tally(rows: Sequence[Row], base: Point) -> dict[str, dict[str, dict[str, float]]]:
    """Per factor, per value (as printed): the rows, how many hold for auto and for split, and the
    median of auto's margin at its best rate (0 where it has none)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for factor in FACTORS:
        groups: dict[str, list[Row]] = {}
        for r in rows:
            groups.setdefault(_factor_text(factor, r.point, base), []).append(r)
        out[factor] = {k: {"points": len(g), "auto_holds": sum(r.auto.holds for r in g),
                           "split_holds": sum(r.split.holds for r in g),
                           "auto_margin_median_rps": statistics.median(
                               r.auto.margin if r.auto.rate is not None else 0.0 for r in g)}
                       for k, g in groups.items()}
    return out


# --- output --------------------------------------------------------------------------

def _factor_text(factor: str, p: Point, base: Point) -> str:
    house = {"compute": p.compute_ratio == base.compute_ratio, "memory": p.memory_speed == base.memory_speed,
             "kv": p.prefill_kv_bytes == base.prefill_kv_bytes, "link": p.link_bps == base.link_bps}[factor]
    text = {"compute": f"{p.compute_ratio:.3g}x", "memory": f"{p.memory_speed:g}x",
            "kv": fmt_bytes(p.prefill_kv_bytes), "link": f"{p.link_bps / 1e9:g} Gb/s"}[factor]
    return text + ("*" if house else "")


def ratio_text(v: Verdict) -> str:
    """A ratio cell: ``-`` (no rate counts), ``inf`` (the rivals serve nothing), ``>99``, ``1.43``."""
    if v.rate is None:
        return "-"
    if math.isinf(v.ratio):
        return "inf"
    return ">99" if v.ratio > 99 else f"{v.ratio:.2f}"


def rates_text(held: Sequence[float], rates: Sequence[float]) -> str:
    """``held``, a subset of ``rates``, as runs of neighbours in ``rates``: ``0.25-0.5,1.5`` (``-``: none)."""
    runs: list[list[float]] = []
    for i, r in enumerate(rates):
        if r not in held:
            continue
        if runs and i > 0 and rates[i - 1] == runs[-1][-1]:
            runs[-1].append(r)
        else:
            runs.append([r])
    return ",".join(f"{run[0]:g}" if len(run) == 1 else f"{run[0]:g}-{run[-1]:g}" for run in runs) or "-"


def _verdict_cells(v: Verdict, names: dict[str, str], rates: Sequence[float]) -> list[str]:
    if v.rate is None:
        return ["-", "-", "-", "-", "-"]
    return [f"{v.rate:g}", ratio_text(v), f"{v.margin:+.3f}", names.get(v.rival or "", "none"),
            rates_text(v.holds_at, rates)]


def render(house: House, workloads: Sequence[str], results: Sequence[Sequence[Row]], slo_text: str,
           rates: Sequence[float], threshold: float, min_goodput: float) -> str:
    """The tables: per workload one row per grid point, then the counts per factor value."""
    names = {PREFILL_ALONE: f"{house.prefill_host} alone", DECODE_ALONE: f"{house.decode_host} alone", POOL: "pool"}
    lines = [f"thesis sweep: {house.prefill_host} prefills for {house.decode_host}; SLO {slo_text}; rates "
             f"{', '.join(f'{r:g}' for r in rates)} req/s; target {threshold:g} x the best of "
             f"{', '.join(names.values())}; a rate counts where the split kind serves >= {min_goodput:g} req/s",
             f"figures: {house.source}",
             f"house (*): compute ratio {house.base.compute_ratio:.3g}x at {RATIO_TOKENS:,} tokens, "
             f"{house.decode_host}'s memory rate 1x, {house.prefill_host}'s KV "
             f"{fmt_bytes(house.base.prefill_kv_bytes)}, "
             f"link {house.base.link_bps / 1e9:g} Gb/s"]
    held = f"{threshold:g}x at"
    head = ["compute", "mem", "P KV", "link", "auto@", "ratio", "margin", "best other", held,
            "split@", "ratio", "margin", "best other", held]
    for workload, rows in zip(workloads, results, strict=True):
        table = [head]
        for r in rows:
            table.append([_factor_text(f, r.point, house.base) for f in FACTORS]
                         + _verdict_cells(r.auto, names, rates) + _verdict_cells(r.split, names, rates))
        widths = [max(len(row[i]) for row in table) for i in range(len(head))]
        lines += ["", f"workload {workload}:"]
        lines += ["  " + "  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
                  for row in table]
        holds_auto = sum(r.auto.holds for r in rows)
        holds_split = sum(r.split.holds for r in rows)
        lines.append(f"  >= {threshold:g}x: auto at {holds_auto} of {len(rows)} points, static split at "
                     f"{holds_split}; per factor value (auto / split / points, auto's median margin in req/s):")
        for factor, cells in tally(rows, house.base).items():
            lines.append(f"    {factor:8s} " + "; ".join(
                f"{k} {c['auto_holds']:.0f}/{c['split_holds']:.0f}/{c['points']:.0f} "
                f"({c['auto_margin_median_rps']:+.2f})" for k, c in cells.items()))
    return "\n".join(lines)


def _values(text: str, parse: Any) -> list[Any]:
    out: list[Any] = []
    for part in text.split(","):
        part = part.strip()
        if part == "house":
            out.append(None)
            continue
        try:
            value = parse(part)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{part!r}: must be positive")
        out.append(value)
    return out


def _floats(text: str) -> list[float | None]:
    return _values(text, float)


def _sizes(text: str) -> list[float | None]:
    return _values(text, lambda s: float(parse_size(s)))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--topology", type=Path, default=HOUSE, help="a two-host split topology (default: the house)")
    ap.add_argument("--run-dir", help="where its measurements are stored (default: the topology's run_dir)")
    ap.add_argument("--connector", help="replace the topology's KV connector (the measurements' kind)")
    ap.add_argument("--workload", action="append", help="classes as disagg bench takes them (repeat; default: "
                    + " and ".join(WORKLOADS) + ")")
    ap.add_argument("--slo", default=SLO_TEXT, help=f"the SLO (default {SLO_TEXT})")
    ap.add_argument("--rates", type=_floats, default=list(RATES), help="req/s, comma-separated")
    ap.add_argument("--compute", type=_floats, default=list(COMPUTE),
                    help="compute ratios, prefill host over decode host ('house': as measured)")
    ap.add_argument("--memory", type=_floats, default=list(MEMORY),
                    help="decode host's memory rate, multiples of the house's")
    ap.add_argument("--kv", type=_sizes, default=list(KV),
                    help="prefill host's KV memory per engine, e.g. 96MiB,house,768MiB")
    ap.add_argument("--link", type=_floats, default=list(LINK), help="line rates in Gb/s ('house': the topology's)")
    ap.add_argument("--threshold", type=float, default=THRESHOLD)
    ap.add_argument("--min-goodput", type=float, default=MIN_GOODPUT)
    ap.add_argument("--json", action="store_true", help="print everything as JSON")
    args = ap.parse_args(argv)
    if any(r is None for r in args.rates):
        ap.error("--rates: numbers only")
    workloads: list[str] = args.workload or list(WORKLOADS)
    started = time.monotonic()
    try:
        slo = parse_slo(args.slo)
        classes = [parse_classes(w) for w in workloads]
        house = load_house(args.topology, classes, slo, args.run_dir, args.connector)
        links = [None if b is None else b * 1e9 for b in args.link]
        points = grid(house.base, args.compute, args.memory, args.kv, links)
        results = sweep(house, points, args.rates, slo, args.threshold, args.min_goodput)
    except (DisaggError, ValueError, OSError, yaml.YAMLError) as exc:
        print(f"thesis_sweep: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({
            "topology": str(args.topology), "source": house.source, "prefill_host": house.prefill_host,
            "decode_host": house.decode_host, "house": house.base.to_json(), "slo": args.slo,
            "rates": args.rates, "threshold": args.threshold, "min_goodput_rps": args.min_goodput,
            "workloads": [{"classes": w, "points": [r.to_json() for r in rows],
                           "tally": tally(rows, house.base)} for w, rows in zip(workloads, results, strict=True)],
            "seconds": time.monotonic() - started}, indent=1))
    else:
        print(render(house, workloads, results, args.slo, args.rates, args.threshold, args.min_goodput))
        print(f"({len(points)} points x {len(workloads)} workloads x {len(args.rates)} rates in "
              f"{time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
