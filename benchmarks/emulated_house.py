"""The emulated house served five ways, and ``disagg plan`` beside the measurements.

The house (``topologies/house-emulated.yaml``): a compute-rich "gamer" whose KV memory binds, a
"workstation" with a fraction of the compute and ample KV memory, a 2.5 Gb/s emulated link. For
each compute/memory ratio (``--ratio``) this script derives four topologies from that file and
runs one ``disagg bench compare`` over them, so five configurations see the identical workload:

- ``gamer``: one engine on the gamer serves everything (its emulated KV cache, its core);
- ``workstation``: one engine on the workstation serves everything;
- ``replicas``: both boxes serve whole requests, the proxy balancing between them;
- ``split``: the house as written, every prompt prefilled on the gamer and decoded on the workstation;
- ``auto``: the same house, the proxy choosing per prompt (split, local, whole).

The SLO is fixed by a rule stated before measuring, from a calibration on the idle engines of the
replica pool (one request at a time, three each, medians): TTFT <= 2 x the gamer's TTFT for the
longest class's prompt, TPOT <= 2 x the workstation's TPOT for the shortest class. The calibration
also measures each box's prefill rate back (prompt tokens over TTFT), so the emulation is checked
against what the topology states.

After the bench (whose probes store each box's measured prefill rate and decode step, per engine
kind, in the ratio's own ``run_dir``; ``--measure`` measures them again with ``disagg bench
prefill`` on the replica pool and the split), ``disagg plan`` predicts
the same workload (``--classes``, ``--rate``, ``--slo``, ``--json``) at every rate, and the script
prints, per configuration, rate and class, the measured and the predicted TTFT p50, TPOT p50 and
goodput, and whether plan's goodput ranking of the five equals the bench's up to ties (differences
inside the repeats' min-max spread).

Run it alone (it starts engines; hold the engine lock, as root for the link's namespace):

    flock /tmp/disagg-engines.lock .venv/bin/python benchmarks/emulated_house.py --out /tmp/house \\
        --ratio base --ratio close=700:384MiB --rates 0.1,0.2,0.4 --repeats 5 -n 16

``--ratio NAME`` keeps the file's figures; ``NAME=RATE:KV`` sets the workstation's emulated prefill
rate (tokens/s) and the gamer's KV memory. Outputs stay under ``--out`` (results.json per ratio,
the bench reports, summary.md); docs/the-one-question.md shows the table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from disagg.prompts import exact_prompt, load_tokenizer
from disagg.topology import load_topology

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
CONFIGS = ("gamer", "workstation", "replicas", "split", "auto")
PREFILL, DECODE = "gamer", "workstation"
CALIBRATION_REPEATS = 3


@dataclass(frozen=True)
class Ratio:
    """One compute/memory ratio of the house: None keeps the file's figure."""

    name: str
    workstation_prefill_rate: float | None = None
    gamer_kv_memory: str | None = None

    @classmethod
    def parse(cls, text: str) -> Ratio:
        name, _, spec = text.partition("=")
        if not spec:
            return cls(name)
        rate, _, kv = spec.partition(":")
        return cls(name, float(rate), kv or None)


def run(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    print("+", " ".join(argv), file=sys.stderr, flush=True)
    return subprocess.run(argv, text=True, cwd=ROOT, check=True, **kw)


def derive(source: Path, ratio: Ratio, out: Path, run_dir: Path | None = None,
           connector: str | None = None) -> dict[str, Path]:
    """The split file (the house with ``ratio`` applied, its KV ``connector`` replaced when given) and
    its three colocated relatives, all with ``run_dir`` (when given): the measurements bench and plan
    share (prefill.json, decode.json, handoff.json, keyed by host) then stay with the ratio whose
    emulation they measured."""
    base = yaml.safe_load(source.read_text())
    if connector is not None:
        base["connector"] = connector
    if run_dir is not None:
        base["run_dir"] = str(run_dir)
    hosts = base["hosts"]
    if ratio.workstation_prefill_rate is not None:
        hosts[DECODE].setdefault("emulate", {})["prefill_rate"] = ratio.workstation_prefill_rate
    if ratio.gamer_kv_memory is not None:
        hosts[PREFILL].setdefault("emulate", {})["kv_memory"] = ratio.gamer_kv_memory
    model = base["model"]
    if not str(model["path"]).startswith("disagg:"):
        model["path"] = str((source.parent / model["path"]).resolve())
    prefill, decode = base["roles"]["prefill"][0], base["roles"]["decode"][0]
    name = f"{base.get('name', source.stem)}-{ratio.name}"
    files: dict[str, dict[str, Any]] = {"split": {**base, "name": f"{name}-split"}}

    def colocated(tag: str, instances: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
        used = {host for host, _ in instances}
        return {"name": f"{name}-{tag}", **({"run_dir": base["run_dir"]} if "run_dir" in base else {}),
                "model": model, "engine": base.get("engine", "vllm"),
                "link": {"type": "loopback"}, "proxy": base.get("proxy", {}),
                "hosts": {h: {**{k: v for k, v in hosts[h].items() if k != "address"}, "address": "127.0.0.1"}
                          for h in used},
                "roles": {"both": [{"host": h, "port": inst["port"], "cpus": inst.get("cpus", []),
                                    "args": inst.get("args", []), "env": inst.get("env", {})}
                                   for h, inst in instances]}}

    files["gamer"] = colocated("gamer", [(PREFILL, prefill)])
    files["workstation"] = colocated("workstation", [(DECODE, decode)])
    files["replicas"] = colocated("replicas", [(PREFILL, prefill), (DECODE, decode)])
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for tag, doc in files.items():
        path = out / f"{name}-{tag}.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        load_topology(path)   # fail here, not after the first bring-up
        paths[tag] = path
    return paths


def _post(url: str, body: dict[str, Any], key: str) -> tuple[float, float, int, int]:
    """(TTFT, end-to-end seconds, prompt tokens, output tokens) of one streamed completion."""
    req = urllib.request.Request(url + "/v1/completions",
                                 data=json.dumps({**body, "stream": True,
                                                  "stream_options": {"include_usage": True}}).encode(),
                                 headers={"content-type": "application/json", "authorization": f"Bearer {key}"})
    t0 = time.monotonic()
    first = None
    usage: dict[str, int] = {}
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("choices") and first is None:
                first = time.monotonic()
            usage = event.get("usage") or usage
    end = time.monotonic()
    assert first is not None, f"{url}: no token came"
    return first - t0, end - t0, usage["prompt_tokens"], usage["completion_tokens"]


def calibrate(replicas: Path, classes: list[tuple[str, int, int]], key: str) -> dict[str, float]:
    """Idle figures from the replica pool's two engines, one request at a time."""
    topo = load_topology(replicas)
    urls = {inst.host: f"http://{topo.hosts[inst.host].address}:{inst.port}" for inst in topo.role("both")}
    model = topo.model.served_name or topo.model.embedded or topo.model.source
    longest = max(classes, key=lambda c: c[1])
    shortest = min(classes, key=lambda c: c[1])
    env = {**os.environ, "DISAGG_ENGINE_KEY": key}
    run([PY, "-m", "disagg", "up", str(replicas), "--detach"], env=env)
    figures: dict[str, float] = {}
    try:
        tok = load_tokenizer(topo.model.path)                   # up builds an embedded model on first use
        for host, url in urls.items():
            ttfts, rates, tpots = [], [], []
            for i in range(CALIBRATION_REPEATS + 1):          # the first warms the engine up
                ttft, _, n_in, _ = _post(url, {"model": model, "max_tokens": 1,
                                               "prompt": exact_prompt(tok, longest[1], f"cal-{host}-{i}-{key[:6]}")},
                                         key)
                short_ttft, e2el, _, n_out = _post(url, {"model": model, "max_tokens": shortest[2], "ignore_eos": True,
                                                "prompt": exact_prompt(tok, shortest[1], f"cat-{host}-{i}")}, key)
                if i:
                    ttfts.append(ttft)
                    rates.append(n_in / ttft)
                    tpots.append((e2el - short_ttft) / max(1, n_out - 1))
            figures[f"{host}_long_ttft_s"] = statistics.median(ttfts)
            figures[f"{host}_prefill_tokens_per_s"] = statistics.median(rates)
            figures[f"{host}_tpot_s"] = statistics.median(tpots)
    finally:
        run([PY, "-m", "disagg", "down", str(replicas)], env=env)
    return figures


def slo_of(cal: dict[str, float]) -> tuple[float, float]:
    """The rule: TTFT <= 2 x the gamer's idle TTFT of the longest prompt, TPOT <= 2 x the
    workstation's idle TPOT."""
    return 2 * cal[f"{PREFILL}_long_ttft_s"], 2 * cal[f"{DECODE}_tpot_s"]


def label_of(doc_label: str) -> str:
    """The configuration a bench label names: a routing variant of the split (``...[auto]``,
    ``...[auto-slo]``) by its policy, a derived topology by its suffix."""
    if doc_label.endswith("]"):
        return doc_label[doc_label.rindex("[") + 1:-1]
    return doc_label.rsplit("-", 1)[-1]


def _median_s(distributions: Any) -> float | None:
    """The median over repeats of a distribution's p50 (bench reports milliseconds), in seconds."""
    values = [d["p50_ms"] / 1000 for d in distributions if d.get("p50_ms") is not None]
    return statistics.median(values) if values else None


def route_shares(runs: list[dict[str, Any]], klass: str) -> dict[str, float] | None:
    """The share of ``klass``'s requests (every class for ``all``) each path served, pooled over
    ``runs``, from the path each record kept (``X-Disagg-Route``); None where no record kept one."""
    routes = [r.get("route") for run in runs for r in run.get("records", ())
              if klass == "all" or r.get("klass") == klass]
    if not any(routes):
        return None
    out: dict[str, float] = {}
    for path in routes:
        out[path or "-"] = out.get(path or "-", 0.0) + 1 / len(routes)
    return out


def measured(results: dict[str, Any]) -> dict[str, dict[float, dict[str, Any]]]:
    """config -> rate -> per class medians over repeats (TTFT p50, with its min and max over the
    repeats; TPOT p50), goodput (median, min, max over repeats) and the paths' shares
    (:func:`route_shares`)."""
    out: dict[str, dict[float, dict[str, Any]]] = {}
    for label, result in results.items():
        config = label_of(label)
        by_rate: dict[float, list[dict[str, Any]]] = {}
        for r in result["runs"]:
            by_rate.setdefault(float(r["rate"]), []).append(r)
        for rate, runs in by_rate.items():
            cell: dict[str, Any] = {}
            for klass in runs[0]["metrics"]:
                ms = [r["metrics"][klass] for r in runs]
                goodputs = [m["goodput"] or 0.0 for m in ms]
                ttfts = [m["ttft"]["p50_ms"] / 1000 for m in ms if m["ttft"].get("p50_ms") is not None]
                pooled = sorted(r["chunk_times"][0] - r["send"] for run in runs for r in run.get("records", ())
                                if (klass == "all" or r["klass"] == klass) and r.get("chunk_times")
                                and r.get("error") is None)
                cell[klass] = {"ttft_p50": _median_s(m["ttft"] for m in ms),
                               "ttft_p50_ci": median_interval(pooled),
                               "ttft_min": min(ttfts, default=None), "ttft_max": max(ttfts, default=None),
                               "tpot_p50": _median_s(m["tpot"] for m in ms),
                               "goodput": statistics.median(goodputs), "goodput_min": min(goodputs),
                               "goodput_max": max(goodputs), "routes": route_shares(runs, klass)}
            out.setdefault(config, {})[rate] = cell
    return out


def median_interval(sorted_values: list[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """The distribution-free interval of a median from ``sorted_values`` (order statistics): the
    j-th smallest and j-th largest, j the largest rank with P(Binomial(n, 1/2) < j) <= (1 -
    confidence) / 2 (n = 25: the 8th and the 18th, 95.7%). None with under 6 values (no such j)."""
    n = len(sorted_values)
    tail, j = 0.0, 0
    while True:
        nxt = tail + math.comb(n, j) / 2 ** n
        if nxt > (1 - confidence) / 2:
            break
        tail, j = nxt, j + 1
    if j == 0:
        return None
    return sorted_values[j - 1], sorted_values[n - j]


def measure(topologies: dict[str, Path], out: Path, env: dict[str, str]) -> None:
    """``disagg bench prefill`` on the replica pool (each box's engine without a KV connector) and
    on the split with ``routing: split`` (each box's engine with the connector, and the pair's
    handoff, which counts only when the proxy splits every probe): what plan reads, measured
    again on purpose (``--measure``)."""
    split = yaml.safe_load(topologies["split"].read_text())
    split["routing"] = {**(split.get("routing") or {}), "policy": "split"}
    forced = topologies["split"].with_name(topologies["split"].stem + "-measure.yaml")
    forced.write_text(yaml.safe_dump(split, sort_keys=False))
    for tag, file in (("replicas", topologies["replicas"]), ("split", forced)):
        run([PY, "-m", "disagg", "up", str(file), "--detach"], env=env)
        try:
            run([PY, "-m", "disagg", "bench", "prefill", str(file), "--json", str(out / f"measure-{tag}.json")],
                env=env)
        finally:
            run([PY, "-m", "disagg", "down", str(file)], env=env)


def predicted(topologies: dict[str, Path], classes_arg: str, rates: list[float], slo: str) -> dict[str, Any]:
    """``disagg plan --json`` for the workload at each rate, from the split file (which names both
    hosts and the link; plan predicts every configuration of them)."""
    out = {}
    for rate in rates:
        done = run([PY, "-m", "disagg", "plan", str(topologies["split"]), "--classes", classes_arg,
                    "--rate", f"{rate:g}", "--slo", slo, "--json"], capture_output=True)
        out[f"{rate:g}"] = json.loads(done.stdout)
    return out


#: the configuration names of ``disagg plan --json`` for the five of the bench
PLAN_LABELS = {"gamer": f"colocated on {PREFILL}", "workstation": f"colocated on {DECODE}",
               "replicas": f"replicas ({PREFILL}, {DECODE})", "split": f"split {PREFILL} -> {DECODE}",
               "auto": f"auto {PREFILL} -> {DECODE}"}
#: plan's TTFT p50 must fall within this of the bench's ...
TTFT_TOLERANCE = 0.25
#: ... where the rate is below this share of the configuration's predicted saturation
BELOW_SATURATION = 0.7


def within_spread(predicted: float | None, interval: tuple[float, float] | None) -> bool | None:
    """Whether plan's TTFT p50 is within :data:`TTFT_TOLERANCE` of the measured median's interval
    (:func:`median_interval` of every request of the cell): where the TTFTs fall in two modes (a
    pool of two unlike boxes, a class behind another's prefills), the measured p50 lands on either
    and this is what the bench can tell. None: too few requests for an interval."""
    if predicted is None or interval is None:
        return None
    lo, hi = interval
    return lo * (1 - TTFT_TOLERANCE) <= predicted <= hi * (1 + TTFT_TOLERANCE)


def plan_cells(plan: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """config -> {"goodput", "saturates_at", class -> {"ttft_p50", "tpot_p50", "routes"}} from one plan --json."""
    by_label = {c["label"]: c for c in plan["configurations"]}
    out: dict[str, dict[str, Any]] = {}
    for config, label in PLAN_LABELS.items():
        c = by_label[label]
        cell: dict[str, Any] = {"goodput": c["goodput_rps"], "saturates_at": c["saturates_at_rps"]}
        for k in c["classes"]:
            cell[k["class"]] = {"ttft_p50": k["ttft_p50_s"], "tpot_p50": k["tpot_p50_s"], "routes": k.get("routes")}
        out[config] = cell
    return out


def ranking_agrees(bench: dict[str, tuple[float, float, float]], plan: dict[str, float]) -> list[str]:
    """The pairs the plan orders against the bench: (a, b) where every repeat of a beat every repeat
    of b (min of a > max of b) but the plan puts b above a. Empty: the rankings agree up to ties."""
    wrong = []
    for a, (_, a_min, _) in bench.items():
        for b, (_, _, b_max) in bench.items():
            if a != b and a_min > b_max and plan[b] > plan[a]:
                wrong.append(f"{a} > {b} measured, {b} > {a} planned")
    return wrong


def validate(measured_: dict[str, dict[float, dict[str, Any]]], predicted_: dict[str, Any],
             classes: list[str]) -> dict[str, Any]:
    """Plan beside bench: per rate and configuration the TTFT p50 check, per rate the ranking,
    per class the split's verdict (does the split answer sooner than the workstation alone, at the
    lowest rate? a tie where the repeats' TTFT p50 ranges overlap)."""
    rows, ranking, verdicts = [], {}, {}
    for rate_text, plan in predicted_.items():
        rate = float(rate_text)
        cells = plan_cells(plan)
        for config in CONFIGS:
            got = measured_.get(config, {}).get(rate)
            if got is None:
                continue
            want = cells[config]
            checked = rate < BELOW_SATURATION * want["saturates_at"]
            for klass in classes:
                m, p = got.get(klass), want.get(klass)
                if m is None or p is None:
                    continue
                ttft_p = p["ttft_p50"]
                err = None if ttft_p is None or not m["ttft_p50"] else ttft_p / m["ttft_p50"] - 1
                rows.append({"rate": rate, "config": config, "class": klass,
                             "ttft_p50": m["ttft_p50"], "ttft_p50_plan": ttft_p,
                             "tpot_p50": m["tpot_p50"], "tpot_p50_plan": p["tpot_p50"],
                             "routes": m.get("routes"), "routes_plan": p.get("routes"),
                             "ttft_error": err, "checked": checked,
                             "ttft_ok": (err is not None and abs(err) <= TTFT_TOLERANCE) if checked else None,
                             "ttft_in_spread": within_spread(ttft_p, m.get("ttft_p50_ci")) if checked else None})
            rows[-1]["goodput"] = got["all"]["goodput"] if "all" in got else None
            rows[-1]["goodput_plan"] = want["goodput"]
        bench_goodput = {c: (measured_[c][rate]["all"]["goodput"], measured_[c][rate]["all"]["goodput_min"],
                             measured_[c][rate]["all"]["goodput_max"])
                         for c in CONFIGS if rate in measured_.get(c, {}) and "all" in measured_[c][rate]}
        ranking[rate_text] = ranking_agrees(bench_goodput, {c: cells[c]["goodput"] for c in bench_goodput})
    lowest = min(predicted_, key=float)
    cells = plan_cells(predicted_[lowest])
    for klass in classes:
        try:
            m_split = measured_["split"][float(lowest)][klass]
            m_local = measured_["workstation"][float(lowest)][klass]
        except KeyError:
            continue
        p_split, p_local = cells["split"][klass]["ttft_p50"], cells["workstation"][klass]["ttft_p50"]
        # a configuration plan calls saturated has no TTFT p50 (its queue grows without bound): later
        # than any it gives; both saturated, no verdict
        inf = float("inf")
        p_split_s, p_local_s = (inf if p is None else p for p in (p_split, p_local))
        # the repeats' TTFT p50 ranges overlapping: the bench cannot tell (a tie, which any verdict matches)
        apart = m_split.get("ttft_max", m_split["ttft_p50"]) < m_local.get("ttft_min", m_local["ttft_p50"]) or \
            m_local.get("ttft_max", m_local["ttft_p50"]) < m_split.get("ttft_min", m_split["ttft_p50"])
        bench_sooner: bool | str = m_split["ttft_p50"] < m_local["ttft_p50"] if apart else "tie"
        plan_sooner = None if p_split_s == p_local_s == inf else p_split_s < p_local_s
        verdicts[klass] = {"bench_split_sooner": bench_sooner, "plan_split_sooner": plan_sooner,
                           "agree": bench_sooner == "tie" or bench_sooner == plan_sooner}
    return {"rows": rows, "ranking_disagreements": ranking, "verdicts": verdicts}


def markdown(entry: dict[str, Any]) -> list[str]:
    """The validation table of one ratio, for docs/the-one-question.md."""
    def ms(x: float | None) -> str:
        return "-" if x is None else (f"{x:.2f} s" if x >= 1 else f"{x * 1000:.0f} ms")

    def paths(shares: dict[str, float] | None) -> str:
        return "-" if not shares else " ".join(f"{k} {100 * v:.0f}%" for k, v in
                                               sorted(shares.items(), key=lambda kv: -kv[1]) if v >= 0.005)

    rows = entry["validation"]["rows"]
    mixed = any(r["config"] == "auto" for r in rows)    # the paths differ by class only where auto chooses
    lines = ["| rate | configuration | class | TTFT p50 bench | plan | TPOT p50 bench | plan | goodput bench | plan |"
             + (" paths bench | plan |" if mixed else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|---|" if mixed else "")]
    for r in rows:
        mark = "" if r["ttft_ok"] is None else (" ok" if r["ttft_ok"] else
                                                (" spread" if r.get("ttft_in_spread") else " **off**"))
        good = (f"{r['goodput']:.3f} | {r['goodput_plan']:.3f}" if "goodput" in r and r["goodput"] is not None
                else " | ")
        route = (f" {paths(r.get('routes'))} | {paths(r.get('routes_plan'))} |" if r["config"] == "auto"
                 else "  |  |") if mixed else ""
        lines.append(f"| {r['rate']:g} | {r['config']} | {r['class']} | {ms(r['ttft_p50'])} | "
                     f"{ms(r['ttft_p50_plan'])}{mark} | {ms(r['tpot_p50'])} | {ms(r['tpot_p50_plan'])} | {good} |"
                     + route)
    return lines


def class_lengths(spec: str) -> list[tuple[str, int, int]]:
    """(name, prompt tokens, output tokens) of bench's ``--classes`` (output 64 where none is given)."""
    classes = []
    for part in spec.split(","):
        name, _, lengths_spec = part.partition("=")
        lengths = lengths_spec.split("@")[0].split(":")
        classes.append((name, int(lengths[0]), int(lengths[1]) if len(lengths) > 1 else 64))
    return classes


def derive_under(args: argparse.Namespace, ratio: Ratio) -> dict[str, Path]:
    """:func:`derive` for ``main``: the ratio's files under ``OUT/RATIO/topologies``, its measurements
    under ``OUT/RATIO/run``."""
    out = args.out / ratio.name
    return derive(args.topology, ratio, out / "topologies", run_dir=out / "run", connector=args.connector)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--topology", type=Path, default=ROOT / "topologies" / "house-emulated.yaml")
    ap.add_argument("--ratio", action="append", type=Ratio.parse, help="NAME or NAME=RATE:KV (repeatable)")
    ap.add_argument("--connector", choices=("nixl", "socket"),
                    help="the split's KV connector instead of the file's (socket: no progress thread polling "
                         "the engines' one core)")
    ap.add_argument("--classes", default="short=256:256@0.5,long=2048:256@0.5")
    ap.add_argument("--rates", default="0.1,0.2,0.4")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("-n", "--num-requests", type=int, default=16)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--measure", action="store_true",
                    help="before planning, measure each box's engines again with `disagg bench prefill` (the "
                         "replica pool and the split); with --replan, for results benched before the probes "
                         "stored what plan reads now")
    ap.add_argument("--routing", default="split,auto",
                    help="the split's routing variants (bench compare --routing); add auto-slo for auto routing "
                         "under the rule's SLO (it is measured, not planned)")
    ap.add_argument("--configs", default=",".join(CONFIGS[:3]),
                    help="the colocated configurations to bench besides the split's variants (default: all three)")
    ap.add_argument("--replan", action="store_true",
                    help="run no engines: plan again beside the bench results already under --out")
    ap.add_argument("--derive-only", action="store_true",
                    help="write each ratio's four topologies under OUT/RATIO/topologies and stop, starting "
                         "nothing (for a `disagg bench compare` of your own over them; the bench and plan "
                         "options are not used)")
    args = ap.parse_args()
    ratios = args.ratio or [Ratio("base")]
    if args.derive_only:
        for ratio in ratios:
            print("\n".join(str(path) for path in derive_under(args, ratio).values()))
        return 0
    rates = [float(r) for r in args.rates.split(",")]
    key = os.environ.get("DISAGG_ENGINE_KEY") or secrets.token_urlsafe(24)
    env = {**os.environ, "DISAGG_ENGINE_KEY": key}
    summary: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "cpu": _cpu(),
                               "connector": args.connector,
                               "loadavg_at_start": os.getloadavg(), "classes": args.classes, "rates": rates,
                               "repeats": args.repeats, "num_requests": args.num_requests, "ratios": {}}
    earlier = json.loads((args.out / "summary.json").read_text()) if args.replan else {}
    if args.replan:
        summary.update({k: earlier[k] for k in ("started", "cpu", "loadavg_at_start", "classes", "rates", "repeats",
                                                "num_requests")})
        args.classes, rates = earlier["classes"], earlier["rates"]
    classes = class_lengths(args.classes)
    for ratio in ratios:
        out = args.out / ratio.name
        tops = derive_under(args, ratio)
        if args.replan:
            cal = earlier["ratios"][ratio.name]["calibration"]
            slo = earlier["ratios"][ratio.name]["slo"]
        else:
            cal = calibrate(tops["replicas"], classes, key)
            ttft_slo, tpot_slo = slo_of(cal)
            slo = f"ttft={ttft_slo * 1000:.0f}ms,tpot={tpot_slo * 1000:.1f}ms"
            print(f"{ratio.name}: calibration {json.dumps(cal)}; SLO {slo}", file=sys.stderr, flush=True)
            colocated = [str(tops[c]) for c in args.configs.split(",") if c]
            run([PY, "-m", "disagg", "bench", "compare", *colocated, str(tops["split"]), "--routing", args.routing,
                 "--classes", args.classes, "--rates", args.rates, "-n", str(args.num_requests),
                 "--repeats", str(args.repeats), "--slo", slo, "--out", str(out / "bench")], env=env)
        if args.measure:
            measure(tops, out, env)
        results = json.loads((out / "bench" / "results.json").read_text())
        entry: dict[str, Any] = {"calibration": cal, "slo": slo, "measured": measured(results)}
        try:
            entry["predicted"] = predicted(tops, args.classes, rates, slo)
        except (subprocess.CalledProcessError, json.JSONDecodeError) as exc:
            entry["predicted_error"] = str(exc)
        else:
            entry["validation"] = validate(entry["measured"], entry["predicted"], [c[0] for c in classes])
            (out / "validation.md").write_text("\n".join(markdown(entry)) + "\n")
            print("\n".join(markdown(entry)), flush=True)
        summary["ratios"][ratio.name] = entry
        (args.out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    summary["loadavg_at_end"] = os.getloadavg()
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    for name, entry in summary["ratios"].items():
        disagree = {r: w for r, w in entry.get("validation", {}).get("ranking_disagreements", {}).items() if w}
        checked = [r for r in entry.get("validation", {}).get("rows", ()) if r["checked"]]
        ok = sum(1 for r in checked if r["ttft_ok"])
        spread = sum(1 for r in checked if not r["ttft_ok"] and r.get("ttft_in_spread"))
        print(f"{name}: SLO {entry['slo']}; verdicts {entry.get('validation', {}).get('verdicts')}; "
              f"ranking disagreements {disagree or 'none'}; TTFT p50 of {len(checked)} checked cells: {ok} within "
              f"{TTFT_TOLERANCE:.0%}, {spread} more within it of the measured median's 95% interval")
    print(f"written: {args.out / 'summary.json'}")
    return 0


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip() + f" ({os.cpu_count()} CPUs)"
    return f"unknown ({os.cpu_count()} CPUs)"


if __name__ == "__main__":
    raise SystemExit(main())
