"""Reports over many runs: JSON, a Markdown table and PNG plots.

The input is a *report document*: ``{label: BenchResult.to_dict()}`` (label =
topology or endpoint name; each result holds one run per request rate), so a
report can be redrawn from its own JSON. Plots (matplotlib, Agg backend):

- ``ttft_cdf.png`` / ``tpot_cdf.png``: one panel per prompt class, one curve
  per label and rate;
- ``goodput_vs_rate.png``: goodput (or request throughput without an SLO)
  against request rate, overall and per class;
- ``p99_vs_rate.png``: p99 TTFT, TPOT and E2EL against request rate.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from disagg.bench.metrics import tpot
from disagg.bench.records import RequestRecord

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


def markdown_table(doc: Document) -> str:
    """One row per label, run and class (``all`` first), latencies in ms."""
    head = ("| run | load | class | ok/failed | req/s | out tok/s | TTFT mean | TTFT p50 | TTFT p99 | "
            "TPOT mean | TPOT p99 | ITL mean | E2EL p99 | goodput req/s | SLO met |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for label, result in doc.items():
        for run in result["runs"]:
            for klass, m in run["metrics"].items():
                att = m.get("slo_attainment")
                lines.append(
                    f"| {label} | {run['label']} | {klass} | {m['completed']}/{m['failed']} | "
                    f"{m['request_throughput']:.2f} | {m['output_throughput']:.1f} | "
                    f"{_fmt(m['ttft']['mean_ms'])} | {_fmt(m['ttft']['median_ms'])} | "
                    f"{_fmt(m['ttft'].get('p99_ms'))} | {_fmt(m['tpot']['mean_ms'])} | "
                    f"{_fmt(m['tpot'].get('p99_ms'))} | {_fmt(m['itl']['mean_ms'])} | "
                    f"{_fmt(m['e2el'].get('p99_ms'))} | {_fmt(m.get('goodput'), 2)} | "
                    f"{'-' if att is None else f'{100 * att:.0f}%'} |")
    return ("Latencies in ms (vLLM bench definitions); throughputs per second of run time.\n"
            f"SLO: {_slo_text(doc) or 'none'}.\n\n" + "\n".join(lines) + "\n")


def text_table(doc: Document) -> str:
    """The same rows as :func:`markdown_table`, aligned for a terminal."""
    head = ("run", "load", "class", "ok", "fail", "req/s", "tok/s", "TTFT mean", "p50", "p99",
            "TPOT mean", "p99", "ITL mean", "E2EL p99", "goodput", "SLO met")
    rows = [head]
    for label, result in doc.items():
        for run in result["runs"]:
            for klass, m in run["metrics"].items():
                att = m.get("slo_attainment")
                rows.append((label, run["label"], klass, str(m["completed"]), str(m["failed"]),
                             f"{m['request_throughput']:.2f}", f"{m['output_throughput']:.1f}",
                             _fmt(m["ttft"]["mean_ms"]), _fmt(m["ttft"]["median_ms"]),
                             _fmt(m["ttft"].get("p99_ms")), _fmt(m["tpot"]["mean_ms"]),
                             _fmt(m["tpot"].get("p99_ms")), _fmt(m["itl"]["mean_ms"]),
                             _fmt(m["e2el"].get("p99_ms")), _fmt(m.get("goodput"), 2),
                             "-" if att is None else f"{100 * att:.0f}%"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(cell.rjust(w) if i > 2 else cell.ljust(w) for i, (cell, w) in enumerate(zip(r, widths,
                                                                                                   strict=True)))
             for r in rows]
    slo = _slo_text(doc)
    return ("latencies in ms; " + (f"SLO {slo}" if slo else "no SLO (goodput not reported)") + "\n"
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
    """CDF of TTFT or TPOT (``metric``), one panel per class, one curve per label and rate."""
    plt = _pyplot()
    classes = _classes(doc)
    fig, axes = _grid(plt, len(classes))
    colors = _label_styles(doc)
    for ax, klass in zip(axes, classes, strict=True):
        for label, result in doc.items():
            for i, run in enumerate(result["runs"]):
                values = _cdf_values(run, klass, metric)
                if not values:
                    continue
                ys = [(k + 1) / len(values) for k in range(len(values))]
                ax.step(values, ys, where="post", color=colors[label], linestyle=_LINESTYLES[i % 4],
                        label=f"{label}, {run['label']}")
        ax.set_title(f"{metric.upper()} CDF, class {klass}")
        ax.set_xlabel(f"{metric.upper()} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(True, alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=7)
    return _save(plt, fig, path)


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
        for label, result in doc.items():
            pts = sorted((run["x"], run["metrics"][klass][what] or 0.0)
                         for run in result["runs"] if klass in run["metrics"])
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=colors[label], label=label)
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
        for label, result in doc.items():
            pts = sorted((run["x"], run["metrics"]["all"][metric].get("p99_ms", 0.0)) for run in result["runs"])
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=colors[label], label=label)
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
