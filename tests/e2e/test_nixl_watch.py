"""Watching the session's NIXL 1P1D (`pd`): the Grafana dashboard's queries read only metrics the
live proxy and engines export, and `disagg top --once --json` and `disagg logs` see the run.

Uses the shared NIXL 1P1D; starts no engine.
"""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from disagg.prompts import exact_prompt
from disagg.watch.metrics import exported_names
from harness.engines import Running, disagg, get_text, routed_stream
from tests.e2e.shared_deployment import NIXL
from tests.unit.watch.dashboard import metric_names, queries

pytestmark = pytest.mark.e2e
SHARED_DEPLOYMENT = NIXL

#: dashboard names only another KV connector exports (checked against its source by the unit test)
OTHER_CONNECTORS = {"vllm:socket_kv_bytes_received_total"}


@pytest.fixture(scope="module")
def one_split(pd: Running, tokenizer: Tokenizer) -> str:
    """One streamed request through the proxy (routing: split), so the histograms have samples."""
    route, text = routed_stream(pd.proxy_url, {"model": "tiny", "prompt": exact_prompt(tokenizer, 200, "watch"),
                                               "max_tokens": 8, "temperature": 0})
    assert route == "split" and text
    return route


def test_every_dashboard_query_reads_live_metrics(pd: Running, one_split: str) -> None:
    live = exported_names(get_text(pd.proxy_url + "/metrics"))
    for url in pd.engines.values():
        live |= exported_names(get_text(url + "/metrics"))
    wanted = set().union(*(metric_names(expr) for _, expr in queries()))
    assert "vllm:nixl_bytes_transferred_sum" in wanted and "vllm:kv_cache_usage_perc" in wanted
    missing = sorted(wanted - OTHER_CONNECTORS - live)
    assert not missing, f"the dashboard queries metrics nothing here exports: {missing}"


def test_top_once_json_sees_the_run(pd: Running, one_split: str) -> None:
    done = disagg("top", "--once", "--json", "--run-dir", str(pd.run_dir), timeout=60)
    assert done.returncode == 0, done.stderr
    snap = json.loads(done.stdout)
    assert snap["proxy"]["up"] is True and snap["window"]["seconds"] is None
    engines = {e["name"]: e for e in snap["engines"]}
    assert set(engines) == {"prefill[0]", "decode[0]"}
    for name, row in engines.items():
        assert row["healthy"] is True and row["status"] == "running", (name, row)
        assert row["running"] is not None and row["waiting"] is not None
        assert row["kv_use"] is not None and 0.0 <= row["kv_use"] <= 1.0
    assert snap["routes"].get("split", 0) >= 1
    assert snap["ttft_s"]["count"] >= 1 and snap["ttft_s"]["p50"] > 0
    assert snap["tpot_s"]["count"] >= 1
    assert snap["rates"]["handoff_bytes_per_s"] is not None   # the engines export NIXL's byte counter


def test_logs_of_one_role(pd: Running) -> None:
    done = disagg("logs", "decode", "--run-dir", str(pd.run_dir), "-n", "5", timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("==> decode[0] (") and lines[0].endswith("decode-0.log) <==")
    assert 1 < len(lines) <= 6
