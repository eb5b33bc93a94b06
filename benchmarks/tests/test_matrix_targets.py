"""benchmarks/matrix_targets.py: the 1.5 x split target where split saturates, and when no run can meet it."""

from __future__ import annotations

from typing import Any

from benchmarks.matrix_targets import check


def _result(goodput: float, done: float, rate: float = 8.0) -> dict[str, Any]:
    run = {"label": f"rate {rate:g}/s", "rate": rate, "repeat": 0,
           "metrics": {"all": {"goodput": goodput, "request_throughput": done},
                       "short": {"ttft": {"count": 10, "median_ms": 100.0}}}}
    return {"runs": [run]}


def _split_row(auto_goodput: float, split_goodput: float) -> str:
    doc = {"replicas": _result(6.8, 7.9), "t[auto]": _result(auto_goodput, 7.9),
           "t[split]": _result(split_goodput, 7.0)}
    rows = check(doc, "replicas", "t[auto]", "t[split]", "short", 0.9)
    (row,) = [r for r in rows if "1.5 x split" in r]
    return row


def test_split_saturated_target_is_checked_against_one_and_a_half_times_split() -> None:
    assert _split_row(6.0, 3.0).endswith("| 4.50 | met |  |")
    assert _split_row(4.0, 3.0).endswith("| 4.50 | MISSED | 1.33 x split |")


def test_a_bound_above_the_offered_rate_gets_no_verdict_and_says_why() -> None:
    row = _split_row(6.57, 6.10)           # 1.5 x 6.10 = 9.15 good requests/s of 8 offered
    assert row.endswith("| 9.15 | - | 1.08 x split; the bound exceeds the offered 8 req/s |")
    assert _split_row(6.0, 0.3).endswith("| 0.45 | met |  |")
