"""Reports over many runs: JSON, a Markdown table and PNG plots.

The input is a *report document*: ``{label: BenchResult.to_dict()}`` (label =
topology or endpoint name; each result holds one run per request rate, or
with repeats several consecutive runs per rate: :func:`step_groups`), so a
report can be redrawn from its own JSON. Tables show per label, step and class
the median over a step's repeats (and the min-max spread of TTFT p50 and
goodput when there are several), then failures by status and the proxy's
route mix (:mod:`disagg.bench.routes`). Written by ``disagg bench serve``
(:mod:`disagg.commands.bench`) and :mod:`disagg.bench.compare`.
Plots (matplotlib, Agg backend):

- ``ttft_cdf.png`` / ``tpot_cdf.png``: one panel per prompt class, one curve
  per label and rate (repeats pooled), log x axis;
- ``goodput_vs_rate.png``: goodput (or request throughput without an SLO)
  against request rate, overall and per class (medians, min-max error bars);
- ``p99_vs_rate.png``: p99 TTFT, TPOT and E2EL against request rate (the same).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from disagg.bench.metrics import compute_metrics, tpot
from disagg.bench.records import RequestRecord
from disagg.bench.routes import merge_deltas, route_summary

Document = Mapping[str, Mapping[str, Any]]

PLOT_FILES = ("ttft_cdf.png", "tpot_cdf.png", "goodput_vs_rate.png", "p99_vs_rate.png")
_LINESTYLES = ("-", "--", ":", "-.")


def write_json(doc: Document, path: Path) -> Path:
    """Write the document as indented JSON; returns the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n", encoding="utf-8")
    return path


def load_json(path: Path) -> dict[str, Any]:
    """Read a document written by :func:`write_json`."""
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def _classes(doc: Document) -> list[str]:
    names: list[str] = []
    for result in doc.values():
        for c in result["workload"]["classes"]:
            if c["name"] not in names:
                names.append(c["name"])
    return names


def _slo_text(doc: Document) -> str:
    slo: Mapping[str, float] = next((r["slo"] for r in doc.values() if r.get("slo")), {})
    return ", ".join(f"{k} <= {v * 1000:g} ms" for k, v in slo.items())


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def step_groups(result: Mapping[str, Any]) -> list[list[Mapping[str, Any]]]:
    """The runs of one result grouped by step: each step's repeats (consecutive runs with the same
    label, as :func:`disagg.bench.runner.run_sweep` writes them), steps in order."""
    groups: list[list[Mapping[str, Any]]] = []
    for run in result["runs"]:
        if groups and groups[-1][0]["label"] == run["label"]:
            groups[-1].append(run)
        else:
            groups.append([run])
    return groups


def _repeated(doc: Document) -> bool:
    return any(len(g) > 1 for result in doc.values() for g in step_groups(result))


#: the table's metrics: key -> (what it reads from a class's metrics, digits)
_COLUMNS: dict[str, tuple[tuple[str, ...], int]] = {
    "req/s": (("request_throughput",), 2), "tok/s": (("output_throughput",), 1),
    "ttft_mean": (("ttft", "mean_ms"), 1), "ttft_p50": (("ttft", "median_ms"), 1), "ttft_p99": (("ttft", "p99_ms"), 1),
    "tpot_mean": (("tpot", "mean_ms"), 1), "tpot_p99": (("tpot", "p99_ms"), 1), "itl_mean": (("itl", "mean_ms"), 1),
    "e2el_p99": (("e2el", "p99_ms"), 1), "goodput": (("goodput",), 2), "slo": (("slo_attainment",), 0)}


def metric_value(m: Mapping[str, Any], keys: tuple[str, ...]) -> float | None:
    """``m[keys[0]][keys[1]]...``; None when absent, and for a latency distribution that holds no
    value (a repeat in which no request of the class completed reports zeros, vLLM's convention:
    not a latency to take a median of)."""
    if len(keys) > 1 and isinstance(dist := m.get(keys[0]), Mapping) and dist.get("count", 1) == 0:
        return None
    v: Any = m
    for k in keys:
        v = v.get(k) if isinstance(v, Mapping) else None
    return None if v is None else float(v)


def _median(values: list[float]) -> float | None:
    return float(statistics.median(values)) if values else None


def _classes_of(group: list[Mapping[str, Any]]) -> list[str]:
    names: list[str] = []
    for run in group:
        names += [k for k in run["metrics"] if k not in names]
    return names


def _group_cells(group: list[Mapping[str, Any]], klass: str) -> dict[str, str]:
    """One table row's cells: the median over the step's repeats of each metric, totals of
    completed and failed requests, and the min-max spread of TTFT p50 and goodput."""
    ms = [run["metrics"][klass] for run in group if klass in run["metrics"]]
    cells = {"ok": str(sum(int(m["completed"]) for m in ms)), "fail": str(sum(int(m["failed"]) for m in ms)),
             "runs": str(len(ms))}
    for name, (keys, digits) in _COLUMNS.items():
        values = [v for m in ms if (v := metric_value(m, keys)) is not None]
        med = _median(values)
        if name == "slo":
            cells[name] = "-" if med is None else f"{100 * med:.0f}%"
        else:
            cells[name] = _fmt(med, digits)
        if name in ("ttft_p50", "goodput"):
            cells[name + "_range"] = (f"{_fmt(min(values), digits)}-{_fmt(max(values), digits)}"
                                      if values else "-")
    return cells


def _rows(doc: Document) -> list[tuple[str, str, str, dict[str, str]]]:
    return [(label, group[0]["label"], klass, _group_cells(group, klass))
            for label, result in doc.items() for group in step_groups(result) for klass in _classes_of(group)]


_MD_COLS = ("req/s", "tok/s", "ttft_mean", "ttft_p50", "ttft_p99", "tpot_mean", "tpot_p99", "itl_mean",
            "e2el_p99", "goodput", "slo")


def markdown_table(doc: Document) -> str:
    """One row per label, step and class (``all`` first), latencies in ms; with repeats each cell is
    the median over the step's repeats, ok/failed the totals, plus the spread of TTFT p50 and goodput."""
    repeated = _repeated(doc)
    head = ("| run | load | class | ok/failed | req/s | out tok/s | TTFT mean | TTFT p50 | TTFT p99 | "
            "TPOT mean | TPOT p99 | ITL mean | E2EL p99 | goodput req/s | SLO met |")
    if repeated:
        head += " repeats | TTFT p50 min-max | goodput min-max |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for label, load, klass, c in _rows(doc):
        line = f"| {label} | {load} | {klass} | {c['ok']}/{c['fail']} | " + " | ".join(c[k] for k in _MD_COLS) + " |"
        if repeated:
            line += f" {c['runs']} | {c['ttft_p50_range']} | {c['goodput_range']} |"
        lines.append(line)
    intro = "Latencies in ms (vLLM bench definitions); throughputs per second of run time.\n"
    if repeated:
        intro += ("Each step ran several times back to back: a cell is the median over its repeats, "
                  "ok/failed the totals, min-max the spread.\n")
    return intro + f"SLO: {_slo_text(doc) or 'none'}.\n\n" + "\n".join(lines) + "\n"


def text_table(doc: Document) -> str:
    """The same rows as :func:`markdown_table`, aligned for a terminal, then the failure and route notes."""
    repeated = _repeated(doc)
    head: tuple[str, ...] = ("run", "load", "class", "ok", "fail", "req/s", "tok/s", "TTFT mean", "p50", "p99",
                             "TPOT mean", "p99", "ITL mean", "E2EL p99", "goodput", "SLO met")
    if repeated:
        head += ("reps", "p50 min-max", "goodput min-max")
    rows = [head]
    for label, load, klass, c in _rows(doc):
        row = (label, load, klass, c["ok"], c["fail"], *(c[k] for k in _MD_COLS))
        if repeated:
            row += (c["runs"], c["ttft_p50_range"], c["goodput_range"])
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(cell.rjust(w) if i > 2 else cell.ljust(w) for i, (cell, w) in enumerate(zip(r, widths,
                                                                                                   strict=True)))
             for r in rows]
    slo = _slo_text(doc)
    notes = [f"failed {line}" for line in failure_lines(doc)]
    notes += [f"trace {line}" for line in trace_lines(doc)]
    notes += [f"EMULATED {line}" for line in emulated_lines(doc)]
    notes += [f"routes {r[0]}, {r[1]}: {r[2]} {r[3]} prompts ({r[4]}; {r[5]}), TTFT mean predicted {r[6]} "
              f"observed {r[7]} ms ({r[8]})" for r in _route_rows(doc)]
    return ("latencies in ms; " + (f"SLO {slo}" if slo else "no SLO (goodput not reported)")
            + ("; with repeats: medians" if repeated else "") + "\n"
            + "\n".join(lines + notes) + "\n")


def failure_lines(doc: Document) -> list[str]:
    """One line per step with failed requests: ``LABEL, LOAD: N failed (HTTP 429 x 10, ...)``,
    summed over the step's repeats (a refusal by the proxy is an HTTP 429 or 503)."""
    out = []
    for label, result in doc.items():
        for group in step_groups(result):
            kinds: dict[str, int] = {}
            for run in group:
                for kind, n in run["metrics"].get("all", {}).get("failures", {}).items():
                    kinds[kind] = kinds.get(kind, 0) + int(n)
            if kinds:
                what = ", ".join(f"{kind} x {n}" for kind, n in sorted(kinds.items()))
                out.append(f"{label}, {group[0]['label']}: {sum(kinds.values())} failed ({what})")
    return out


def emulated_lines(doc: Document) -> list[str]:
    """Per label whose topology emulates hardware (hosts with ``emulate:``): what each host emulates,
    so no figure of an emulated host is read as a real machine's."""
    return [f"{label}: {line}" for label, result in doc.items() for line in result.get("emulated", ())]


def trace_lines(doc: Document) -> list[str]:
    """Per label benched with a trace: the file, the requests used of the rows read (skipped and
    reordered rows), the time scales and how many requests were cut to the model's max_model_len;
    empty when no workload came from a trace."""
    out = []
    for label, result in doc.items():
        trace = result.get("workload", {}).get("trace")
        if not trace:
            continue
        runs = result["runs"]
        scales = ", ".join(dict.fromkeys(f"x{r['time_scale']:g}" for r in runs if r.get("time_scale")))
        capped = [r.get("capped") for r in runs]
        if capped and all(c is not None for c in capped):
            cut = f"{max(capped)} capped to max_model_len"
        else:
            cut = "lengths not checked against max_model_len (no /tokenize reported it)"
        skipped = trace["skipped_zero_length"]
        extra = [f"{skipped} rows with a zero length skipped"] if skipped else []
        extra += [f"{trace['reordered']} out-of-order rows sorted"] if trace["reordered"] else []
        limit = f", --trace-limit {trace['limit']}" if trace.get("limit") else ""
        out.append(f"{label}: trace {trace['file']} ({trace['format']}): {trace['requests']} requests of "
                   f"{trace['rows_read']} rows read{limit}, spanning {trace['span_s']:.1f} s, time scale {scales}; "
                   + "; ".join([cut, *extra]))
    return out


def load_lines(doc: Document) -> list[str]:
    """Per label: the load average before its topology came up (compare) and the range over its runs'
    starts and ends; empty for documents written before the load was recorded."""
    out = []
    for label, result in doc.items():
        during = [v for run in result["runs"] for v in (run.get("loadavg") or ())]
        before = result.get("loadavg_before_up")
        parts = ([f"before up {before:.2f}"] if before is not None else []) + \
                ([f"during runs {min(during):.2f}-{max(during):.2f}"] if during else [])
        if parts:
            out.append(f"{label}: " + ", ".join(parts))
    return out


def _route_rows(doc: Document) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for label, result in doc.items():
        for group in step_groups(result):
            merged = merge_deltas(run.get("routes") for run in group)
            if merged is None:
                continue
            for path, s in route_summary(merged).items():
                share = s["share"]
                err = s["relative_error"]
                mae = s.get("mean_abs_error")
                reasons = ", ".join(f"{r} {n:g}" for r, n in sorted(s["reasons"].items()))
                rows.append((label, str(group[0]["label"]), path, f"{s['prompts']:g}",
                             "-" if share is None else f"{100 * share:.0f}%", reasons or "-",
                             _fmt(s["predicted_ttft_ms"]), _fmt(s["observed_ttft_ms"]),
                             "-" if err is None else f"{100 * err:+.0f}%",
                             "-" if mae is None else f"{100 * mae:.0f}%"))
    return rows


def routes_table(doc: Document) -> str:
    """The proxy's route mix per step (summed over repeats): prompts and share per path, why, and the
    mean predicted vs mean observed TTFT of the path (ms) with the prediction's relative error.
    Empty when no endpoint exposed the routing metrics."""
    rows = _route_rows(doc)
    if not rows:
        return ""
    head = ("| run | load | path | prompts | share | reasons | predicted TTFT mean | observed TTFT mean | "
            "error of the means | mean abs error per prompt |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)] + ["| " + " | ".join(r) + " |" for r in rows]
    return ("Route mix (the proxy's `disagg_route_total` and its predicted/observed TTFT histograms, "
            "deltas over the measured runs):\n\n" + "\n".join(lines) + "\n")


def _class_path_rows(doc: Document) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for label, result in doc.items():
        for group in step_groups(result):
            recs = [RequestRecord.from_dict(r) for run in group for r in run["records"]]
            if not any(r.route for r in recs):
                continue
            duration = sum(float(run["duration_s"]) for run in group)
            for klass in dict.fromkeys(r.klass for r in recs):
                mine = [r for r in recs if r.klass == klass]
                by_path: dict[str, list[RequestRecord]] = {}
                for r in mine:
                    by_path.setdefault(r.route or "-", []).append(r)
                for path, served in sorted(by_path.items(), key=lambda kv: (-len(kv[1]), kv[0])):
                    m = compute_metrics(served, duration)
                    rows.append((label, str(group[0]["label"]), klass, path, str(len(served)),
                                 f"{100 * len(served) / len(mine):.0f}%",
                                 _fmt(1000 * m.ttft.median if m.ttft.count else None),
                                 _fmt(1000 * m.tpot.median if m.tpot.count else None)))
    return rows


def class_paths_table(doc: Document) -> str:
    """Per step and prompt class, the paths that served its requests (their ``X-Disagg-Route``,
    pooled over the repeats): prompts, share of the class, TTFT and TPOT p50 (ms). Empty when no
    record carries a route (a target without the project's proxy, or a report written before
    records kept it)."""
    rows = _class_path_rows(doc)
    if not rows:
        return ""
    head = "| run | load | class | path | prompts | share of class | TTFT p50 | TPOT p50 |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)] + ["| " + " | ".join(r) + " |" for r in rows]
    return ("Paths per class (each request's `X-Disagg-Route`, pooled over the repeats; ms):\n\n"
            + "\n".join(lines) + "\n")


def write_markdown(doc: Document, path: Path, title: str = "disagg bench report") -> Path:
    """Write a Markdown report with the table and links to the plots."""
    path.parent.mkdir(parents=True, exist_ok=True)
    first = next(iter(doc.values()), None)
    wl = first["workload"] if first else {}
    classes = ", ".join(f"{c['name']} {c['input_len']}->{c['output_len']}" for c in wl.get("classes", []))
    body = [f"# {title}", "",
            f"Workload: {wl.get('num_requests')} requests, arrivals {wl.get('arrival')} "
            f"(burstiness {wl.get('burstiness')}), seed {wl.get('seed')}, API {wl.get('api')}, "
            f"classes (prompt->answer tokens): {classes}.", "",
            markdown_table(doc), ""]
    if traces := trace_lines(doc):
        body += ["Workload from a trace (arrivals and lengths replayed; one class, `trace`):", "",
                 *(f"- {line}" for line in traces), ""]
    if emulated := emulated_lines(doc):
        body += ["Emulated hardware (prefill rate held by a vLLM plugin, KV cache capped, CPU quota; memory "
                 "bandwidth and power are not emulated):", "", *(f"- {line}" for line in emulated), ""]
    if fails := failure_lines(doc):
        body += ["Failed requests by status (a refusal by the proxy is HTTP 429 or 503):", "",
                 *(f"- {line}" for line in fails), ""]
    if routes := routes_table(doc):
        body += [routes, ""]
    if paths := class_paths_table(doc):
        body += [paths, ""]
    if loads := load_lines(doc):
        body += ["Machine load (1-minute load average; during runs the engines under test add their own):", "",
                 *(f"- {line}" for line in loads), ""]
    body += [f"![{name}]({name})" for name in PLOT_FILES]
    path.write_text("\n".join(body) + "\n", encoding="utf-8")
    return path


def _records(run: Mapping[str, Any], klass: str) -> list[RequestRecord]:
    recs = [RequestRecord.from_dict(r) for r in run["records"]]
    return [r for r in recs if r.success and (klass == "all" or r.klass == klass)]


def _cdf_values(run: Mapping[str, Any], klass: str, metric: str) -> list[float]:
    out = []
    for r in _records(run, klass):
        ttft, e2el = r.ttft, r.e2el
        assert ttft is not None and e2el is not None
        if metric == "ttft":
            out.append(ttft * 1000)
        elif (t := tpot(e2el, ttft, r.output_tokens)) is not None:
            out.append(t * 1000)
    return sorted(out)


def _pyplot() -> Any:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(plt: Any, fig: Any, path: Path) -> Path:
    """Lay out, write the PNG and free the figure."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _grid(plt: Any, panels: int) -> tuple[Any, list[Any]]:
    cols = min(panels, 3)
    rows = math.ceil(panels / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 4.0 * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[panels:]:
        ax.set_visible(False)
    return fig, flat[:panels]


def _label_styles(doc: Document) -> dict[str, str]:
    colors = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink")
    return {label: colors[i % len(colors)] for i, label in enumerate(doc)}


def plot_cdf(doc: Document, metric: str, path: Path) -> Path:
    """CDF of TTFT or TPOT (``metric``), one panel per class, one curve per label and step (a step's
    repeats pooled), on a log x axis: good curves crowd at zero on a linear one."""
    plt = _pyplot()
    classes = _classes(doc)
    fig, axes = _grid(plt, len(classes))
    colors = _label_styles(doc)
    for ax, klass in zip(axes, classes, strict=True):
        for label, result in doc.items():
            for i, group in enumerate(step_groups(result)):
                values = sorted(v for run in group for v in _cdf_values(run, klass, metric) if v > 0)
                if not values:
                    continue
                ys = [(k + 1) / len(values) for k in range(len(values))]
                ax.step(values, ys, where="post", color=colors[label], linestyle=_LINESTYLES[i % 4],
                        label=f"{label}, {group[0]['label']}" + (f" (x{len(group)})" if len(group) > 1 else ""))
        ax.set_title(f"{metric.upper()} CDF, class {klass}")
        if ax.has_data():
            ax.set_xscale("log")
        ax.set_xlabel(f"{metric.upper()} (ms, log scale)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(True, alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=7)
    return _save(plt, fig, path)


#: (x, median y, min y, max y) of one step
_Point = tuple[float, float, float, float]


def _points(result: Mapping[str, Any], read: Callable[[Mapping[str, Any]], float | None]) -> list[_Point]:
    """Per step: the median x (offered or achieved rate) and the median, min and max over its repeats
    of ``read(run metrics)`` (None: the run lacks it)."""
    pts = []
    for group in step_groups(result):
        ys = [y for run in group if (y := read(run["metrics"])) is not None]
        if ys:
            x = float(statistics.median(float(run["x"]) for run in group))
            pts.append((x, float(statistics.median(ys)), min(ys), max(ys)))
    return sorted(pts)


def _plot_points(ax: Any, pts: list[_Point], color: str, label: str) -> None:
    """A line through the medians; the min-max spread as error bars when a step ran more than once."""
    if not pts:
        return
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    ax.plot(xs, ys, marker="o", color=color, label=label)
    if any(p[2] != p[3] for p in pts):
        ax.errorbar(xs, ys, yerr=[[p[1] - p[2] for p in pts], [p[3] - p[1] for p in pts]], fmt="none",
                    ecolor=color, capsize=3, alpha=0.7)


def plot_goodput(doc: Document, path: Path) -> Path:
    """Goodput (request throughput when no SLO was given) vs request rate, overall and per class."""
    plt = _pyplot()
    panels = ["all", *_classes(doc)]
    fig, axes = _grid(plt, len(panels))
    colors = _label_styles(doc)
    has_slo = any(r.get("slo") for r in doc.values())
    slo_text = _slo_text(doc)
    what = "goodput" if has_slo else "request_throughput"
    for ax, klass in zip(axes, panels, strict=True):
        def read(m: Mapping[str, Any], k: str = klass) -> float | None:
            return float(m[k][what] or 0.0) if k in m else None

        for label, result in doc.items():
            _plot_points(ax, _points(result, read), colors[label], label)
        ax.set_title(f"{'goodput' if has_slo else 'throughput'}, {klass}" + (f"\n(SLO {slo_text})" if has_slo else ""))
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("good requests/s" if has_slo else "completed requests/s")
        ax.grid(True, alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=8)
    return _save(plt, fig, path)


def plot_p99(doc: Document, path: Path) -> Path:
    """p99 TTFT, TPOT and E2EL (all classes) vs request rate, one curve per label."""
    plt = _pyplot()
    fig, axes = _grid(plt, 3)
    colors = _label_styles(doc)
    for ax, metric in zip(axes, ("ttft", "tpot", "e2el"), strict=True):
        def p99(m: Mapping[str, Any], k: str = metric) -> float | None:
            return metric_value(m["all"], (k, "p99_ms"))

        for label, result in doc.items():
            _plot_points(ax, _points(result, p99), colors[label], label)
        ax.set_title(f"p99 {metric.upper()}, all classes")
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("ms")
        ax.grid(True, alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=8)
    return _save(plt, fig, path)


def write_report(doc: Document, out_dir: Path, title: str = "disagg bench report") -> list[Path]:
    """Write ``results.json``, ``report.md`` and the four PNGs into ``out_dir``; returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return [write_json(doc, out_dir / "results.json"),
            write_markdown(doc, out_dir / "report.md", title),
            plot_cdf(doc, "ttft", out_dir / "ttft_cdf.png"),
            plot_cdf(doc, "tpot", out_dir / "tpot_cdf.png"),
            plot_goodput(doc, out_dir / "goodput_vs_rate.png"),
            plot_p99(doc, out_dir / "p99_vs_rate.png")]
