"""The Grafana dashboard's queries and the metric names they read (the unit and e2e dashboard tests)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parents[3] / "dashboards" / "disagg.json"

#: a metric name in a query: ours (``disagg_``) or an engine's (``vllm:``); label names, functions,
#: keywords and Grafana's ``$__`` macros never start with either
METRIC = re.compile(r"(?<![\w:])(?:disagg_|vllm:)[A-Za-z0-9_:]*")
#: sample-name suffixes a query may add to a family's name
SUFFIXES = ("_bucket", "_sum", "_count", "_total")


def load() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel that queries (rows hold none)."""
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def queries(dashboard: dict[str, Any] | None = None) -> list[tuple[str, str]]:
    """(panel title, expression) of every query."""
    return [(p["title"], t["expr"]) for p in panels(dashboard or load()) for t in p["targets"]]


def metric_names(expr: str) -> set[str]:
    """The metric names one PromQL expression reads."""
    return set(METRIC.findall(expr))


def family(name: str) -> str:
    """``vllm:nixl_bytes_transferred_sum`` -> ``vllm:nixl_bytes_transferred``."""
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name
