"""disagg.bench.report: JSON, Markdown and PNG plots from synthetic results."""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path

from disagg.bench.report import PLOT_FILES, load_json, markdown_table, write_report
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
