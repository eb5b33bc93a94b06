"""dashboards/disagg.json: a Grafana dashboard whose queries read only metrics that exist.

Here, without engines: the proxy's names against a real ProxyMetrics exposition, the engines'
against the vLLM and socket-connector sources that declare them. The e2e test
(tests/e2e/test_nixl_watch.py) checks every name against the live /metrics of a deployment.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from disagg.proxy.metrics import ProxyMetrics
from disagg.watch.metrics import exported_names
from tests.unit.watch.dashboard import family, load, metric_names, panels, queries

ROOT = Path(__file__).resolve().parents[3]


def _vllm_sources() -> str:
    spec = importlib.util.find_spec("vllm")          # finds the package without importing it
    assert spec is not None and spec.origin is not None, "vLLM is part of the project's environment"
    vllm = Path(spec.origin).parent
    files = [vllm / "v1" / "metrics" / "loggers.py",
             vllm / "distributed" / "kv_transfer" / "kv_connector" / "v1" / "nixl" / "stats.py",
             ROOT / "connectors" / "socket_connector" / "stats.py"]
    return "\n".join(f.read_text() for f in files)


def test_the_dashboard_is_grafana_json_with_a_datasource_variable() -> None:
    dash = load()
    assert dash["schemaVersion"] >= 36 and dash["uid"] and dash["title"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels(dash):
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        assert all(t["datasource"] == panel["datasource"] for t in panel["targets"])


def test_panels_do_not_overlap() -> None:
    taken: dict[tuple[int, int], str] = {}
    for panel in load()["panels"]:
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24, panel["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in taken, f"{panel['title']} overlaps {taken.get((x, y))}"
                taken[(x, y)] = panel["title"]


def test_the_panels_a_person_wants_first() -> None:
    titles = " | ".join(p["title"] for p in panels(load())).lower()
    for wanted in ("ttft p50 / p99", "tpot p50 / p99", "goodput", "route mix", "queues", "kv-cache use",
                   "handoff rate", "errors and fallbacks"):
        assert wanted in titles, wanted


def test_every_query_reads_metrics_the_proxy_or_the_engines_export() -> None:
    proxy = exported_names(ProxyMetrics().render().decode())
    engines = _vllm_sources()
    for title, expr in queries():
        names = metric_names(expr)
        assert names, f"{title}: {expr} reads no disagg_ or vllm: metric"
        for name in names:
            if name.startswith("disagg_"):
                assert name in proxy, f"{title}: {name} is not a metric of the proxy"
            else:
                assert f'"{family(name)}"' in engines, f"{title}: {name} is declared by neither vLLM nor our connector"


def test_the_slo_choices_are_bucket_bounds_of_the_histograms() -> None:
    metrics = ProxyMetrics()
    text = metrics.render().decode()
    variables = {v["name"]: v for v in load()["templating"]["list"]}
    for var, histogram in (("ttft_slo", "disagg_proxy_ttft_seconds"), ("tpot_slo", "disagg_proxy_tpot_seconds")):
        values = [o["value"] for o in variables[var]["options"]]
        assert values and variables[var]["current"]["value"] in values
        for value in values:
            assert f'{histogram}_bucket{{le="{value}"}}' in text, f"{var}={value} is no bucket bound of {histogram}"
