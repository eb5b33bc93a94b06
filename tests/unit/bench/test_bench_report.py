"""disagg.bench.report: JSON, Markdown and PNG plots from synthetic results."""

from __future__ import annotations

import statistics
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from disagg.bench import report
from disagg.bench.records import RequestRecord
from disagg.bench.report import (
    PLOT_FILES,
    class_paths_table,
    failure_lines,
    load_json,
    markdown_table,
    plot_cdf,
    routes_table,
    step_groups,
    text_table,
    write_report,
)
from disagg.bench.runner import BenchResult


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def _doc(synthetic: Callable[..., BenchResult]) -> dict:
    return {"colocated": synthetic(0).to_dict(), "1p1d": synthetic(2).to_dict()}


def test_write_report_files(tmp_path: Path, synthetic) -> None:
    doc = _doc(synthetic)
    paths = write_report(doc, tmp_path / "out", title="synthetic")
    names = {p.name for p in paths}
    assert names == {"results.json", "report.md", *PLOT_FILES}
    for name in PLOT_FILES:
        width, height = _png_size(tmp_path / "out" / name)
        assert 500 <= width <= 2500 and 350 <= height <= 2000, (name, width, height)
        assert (tmp_path / "out" / name).stat().st_size > 10_000          # not an empty canvas
    again = load_json(tmp_path / "out" / "results.json")
    assert again["1p1d"]["runs"][2]["metrics"]["all"]["completed"] == 40
    md = (tmp_path / "out" / "report.md").read_text()
    assert md.startswith("# synthetic") and "![ttft_cdf.png](ttft_cdf.png)" in md


def test_markdown_table_rows(synthetic) -> None:
    doc = _doc(synthetic)
    table = markdown_table(doc)
    rows = [line for line in table.splitlines() if line.startswith("| colocated") or line.startswith("| 1p1d")]
    assert len(rows) == 2 * 3 * 3                 # labels x rates x (all, long, short)
    assert "SLO: ttft <= 300 ms, tpot <= 50 ms." in table
    first = doc["colocated"]["runs"][0]["metrics"]["all"]
    assert f"| colocated | rate 0.5/s | all | 40/0 | {first['request_throughput']:.2f} |" in table
    header = table.splitlines()[3]
    assert header.count("|") == rows[0].count("|")


def test_report_redraws_from_its_own_json(tmp_path: Path, synthetic) -> None:
    write_report(_doc(synthetic), tmp_path / "a")
    doc = load_json(tmp_path / "a" / "results.json")
    paths = write_report(doc, tmp_path / "b")
    assert all(p.exists() for p in paths)


def _repeated_doc(synthetic: Callable[..., BenchResult]) -> dict:
    """One label whose two steps each ran three times (the repeats differ: seeds 0, 1, 2)."""
    reps = [synthetic(k, rates=(1.0, 2.0)).to_dict() for k in range(3)]
    doc = reps[0]
    doc["runs"] = [dict(reps[k]["runs"][step], repeat=k) for step in range(2) for k in range(3)]
    doc["repeats"] = 3
    return {"auto": doc}


def test_repeats_show_the_median_and_the_spread(synthetic) -> None:
    doc = _repeated_doc(synthetic)
    assert [len(g) for g in step_groups(doc["auto"])] == [3, 3]
    table = markdown_table(doc)
    assert "median over its repeats" in table
    header = table.splitlines()[4]
    assert header.endswith("| repeats | TTFT p50 min-max | goodput min-max |")
    rows = [line for line in table.splitlines() if line.startswith("| auto | rate 1/s | all |")]
    assert len(rows) == 1 and rows[0].count("|") == header.count("|")
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    p50s = sorted(r["metrics"]["all"]["ttft"]["median_ms"] for r in doc["auto"]["runs"][:3])
    assert cells[3] == "120/0"                                  # totals over the repeats
    assert cells[7] == f"{p50s[1]:.1f}"                         # TTFT p50: the median repeat
    assert cells[15] == "3" and cells[16] == f"{p50s[0]:.1f}-{p50s[2]:.1f}"
    assert len([line for line in table.splitlines() if line.startswith("| auto |")]) == 2 * 3
    text = text_table(doc)
    assert "with repeats: medians" in text and "p50 min-max" in text


def test_a_single_run_per_step_keeps_the_plain_table(synthetic) -> None:
    table = markdown_table(_doc(synthetic))
    assert "repeats" not in table and "min-max" not in table
    assert table.splitlines()[3].endswith("| goodput req/s | SLO met |")


def test_failures_by_status_and_route_mix_in_the_report(tmp_path: Path, synthetic) -> None:
    doc = _repeated_doc(synthetic)
    runs = doc["auto"]["runs"]
    runs[0]["metrics"]["all"]["failures"] = {"HTTP 429": 2}
    runs[1]["metrics"]["all"]["failures"] = {"HTTP 429": 1, "HTTP 503": 1}
    delta = {"routes": {"local": {"predicted": 3}, "split": {"predicted": 1}},
             "predicted_ttft": {"split": {"sum_s": 0.1, "count": 1}, "local": {"sum_s": 0.06, "count": 3}},
             "observed_ttft": {"split": {"sum_s": 0.08, "count": 1}, "local": {"sum_s": 0.06, "count": 3}}}
    runs[0]["routes"] = runs[1]["routes"] = delta
    assert failure_lines(doc) == ["auto, rate 1/s: 4 failed (HTTP 429 x 3, HTTP 503 x 1)"]
    routes = routes_table(doc)
    # two repeats pooled: 8 prompts, split 2 of them (25%), predicted 100 ms vs 80 observed: +25%
    assert "| auto | rate 1/s | split | 2 | 25% | predicted 2 | 100.0 | 80.0 | +25% |" in routes
    assert "| auto | rate 1/s | local | 6 | 75% | predicted 6 | 20.0 | 20.0 | +0% |" in routes
    assert "rate 2/s" not in routes                             # no routing series there: left out
    write_report(doc, tmp_path / "out")
    md = (tmp_path / "out" / "report.md").read_text()
    assert "- auto, rate 1/s: 4 failed (HTTP 429 x 3, HTTP 503 x 1)" in md and "Route mix" in md
    assert "failed auto, rate 1/s: 4 failed" in text_table(doc)
    assert routes_table(_doc(synthetic)) == "" and failure_lines(_doc(synthetic)) == []


def test_paths_per_class_pool_the_repeats_records(synthetic) -> None:
    doc = _repeated_doc(synthetic)
    assert class_paths_table(doc) == ""                         # no record names a route
    for run in doc["auto"]["runs"]:
        for r in run["records"]:
            r["route"] = "split" if r["klass"] == "long" or r["index"] % 4 == 1 else "local"
    table = class_paths_table(doc)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()
            if line.startswith("| auto | rate 1/s |")]
    # three repeats of 40 requests: 60 long, all split; 60 short, one in two split
    assert [r[2:6] for r in rows] == [["long", "split", "60", "100%"], ["short", "local", "30", "50%"],
                                      ["short", "split", "30", "50%"]]
    # each path's own requests: the short class's split half has its own TTFT p50
    short_split = [RequestRecord.from_dict(r) for run in doc["auto"]["runs"][:3] for r in run["records"]
                   if r["klass"] == "short" and r["route"] == "split"]
    assert float(rows[2][6]) == pytest.approx(1000 * statistics.median(r.ttft for r in short_split), abs=0.05)


def test_cdf_plots_use_a_log_axis(tmp_path: Path, synthetic, monkeypatch: pytest.MonkeyPatch) -> None:
    scales: list[str] = []
    real_save = report._save

    def save(plt: Any, fig: Any, path: Path) -> Path:
        scales.extend(ax.get_xscale() for ax in fig.axes if ax.get_visible())
        return real_save(plt, fig, path)

    monkeypatch.setattr(report, "_save", save)
    plot_cdf(_repeated_doc(synthetic), "ttft", tmp_path / "ttft.png")
    plot_cdf(_doc(synthetic), "tpot", tmp_path / "tpot.png")
    assert scales == ["log"] * 4                                # 2 classes x 2 plots


def test_a_repeat_without_completed_requests_is_no_latency(synthetic) -> None:
    doc = _repeated_doc(synthetic)
    runs = doc["auto"]["runs"]
    runs[0]["metrics"]["short"]["ttft"] = {"count": 0, "mean_ms": 0.0, "std_ms": 0.0, "median_ms": 0.0,
                                           "p50_ms": 0.0, "p90_ms": 0.0, "p99_ms": 0.0}
    row = next(line for line in markdown_table(doc).splitlines() if line.startswith("| auto | rate 1/s | short |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    p50s = sorted(r["metrics"]["short"]["ttft"]["median_ms"] for r in runs[1:3])
    assert cells[7] == f"{(p50s[0] + p50s[1]) / 2:.1f}" and cells[16] == f"{p50s[0]:.1f}-{p50s[1]:.1f}"


def test_load_lines_say_what_else_ran(synthetic) -> None:
    doc = _doc(synthetic)
    assert report.load_lines(doc) == []               # documents from before the load was recorded
    doc["1p1d"]["loadavg_before_up"] = 0.25
    for k, run in enumerate(doc["1p1d"]["runs"]):
        run["loadavg"] = [1.0 + k, 2.5 + k]
    assert report.load_lines(doc) == ["1p1d: before up 0.25, during runs 1.00-4.50"]
