"""disagg top's snapshot from scrapes: percentiles, rates, route mix, engines (no I/O).

The proxy's text is the real ProxyMetrics exposition after real observations; the engines' text is
vLLM's exposition format with the names vLLM 0.32 exports.
"""

from __future__ import annotations

import math

import pytest

from disagg.proxy.metrics import ProxyMetrics
from disagg.watch.metrics import Metrics, MetricsError, exported_names
from disagg.watch.snapshot import Process, Scrape, build_snapshot, histogram_quantile

PROCS = [Process("prefill[0]", "gpu-box", "running", 0), Process("decode[0]", "local", "backoff", 2)]


def engine_text(running: float, waiting: float, kv: float, nixl_bytes: float | None = None,
                socket_bytes: float | None = None, kv_name: str = "vllm:kv_cache_usage_perc") -> str:
    labels = 'engine="0",model_name="tiny"'
    text = (f"# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{{labels}}} {running}\n"
            f"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{{labels}}} {waiting}\n"
            f"# TYPE {kv_name} gauge\n{kv_name}{{{labels}}} {kv}\n")
    if nixl_bytes is not None:
        text += ("# TYPE vllm:nixl_bytes_transferred histogram\n"
                 f'vllm:nixl_bytes_transferred_bucket{{{labels},le="+Inf"}} 3.0\n'
                 f"vllm:nixl_bytes_transferred_count{{{labels}}} 3.0\n"
                 f"vllm:nixl_bytes_transferred_sum{{{labels}}} {nixl_bytes}\n")
    if socket_bytes is not None:
        text += ("# TYPE vllm:socket_kv_bytes_received counter\n"
                 f"vllm:socket_kv_bytes_received_total{{{labels}}} {socket_bytes}\n")
    return text


def scrape(at: float, proxy: ProxyMetrics | None, engines: dict[str, str | None],
           health: dict[str, int | None] | None = None) -> Scrape:
    return Scrape(at=at, proxy=Metrics.parse(proxy.render().decode()) if proxy else None,
                  engines={k: Metrics.parse(v) if v is not None else None for k, v in engines.items()},
                  health=health or {k: 200 for k in engines},
                  errors={} if proxy else {"proxy": "connection refused"})


def test_histogram_quantile_interpolates_as_prometheus_does() -> None:
    buckets = {0.1: 0.0, 0.2: 10.0, 0.4: 20.0, math.inf: 20.0}
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.2)
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.15)
    assert histogram_quantile(0.75, buckets) == pytest.approx(0.3)
    # the first bucket starts at 0
    assert histogram_quantile(0.5, {1.0: 4.0, math.inf: 4.0}) == pytest.approx(0.5)
    # in the +Inf bucket: the highest finite bound
    assert histogram_quantile(0.99, {1.0: 1.0, 2.0: 1.0, math.inf: 10.0}) == 2.0
    assert histogram_quantile(0.5, {1.0: 0.0, math.inf: 0.0}) is None
    assert histogram_quantile(0.5, {}) is None


def test_percentiles_rates_and_route_mix_over_the_window() -> None:
    proxy = ProxyMetrics()
    for ttft in (5.0, 5.0):            # before the window: must not count
        proxy.ttft.observe(ttft)
    proxy.route.labels(path="split", reason="predicted").inc(4)
    base = scrape(0.0, proxy, {"prefill[0]": engine_text(0, 0, 0.1, nixl_bytes=1e6), "decode[0]": None})

    for ttft in (0.12, 0.14, 0.16, 0.18, 0.9):
        proxy.ttft.observe(ttft)
    for tpot in (0.02, 0.02, 0.03):
        proxy.tpot.observe(tpot)
    proxy.requests.labels(endpoint="completions", path="disaggregated").inc(3)
    proxy.route.labels(path="split", reason="predicted").inc(3)
    proxy.route.labels(path="local", reason="predicted").inc(1)
    proxy.fallbacks.labels(reason="timeout").inc()
    proxy.upstream_errors.labels(role="prefill", kind="timeout").inc()
    previous = scrape(58.0, proxy, {"prefill[0]": engine_text(1, 0, 0.2, nixl_bytes=2e6),
                                    "decode[0]": engine_text(1, 0, 0.1)})

    proxy.requests.labels(endpoint="completions", path="disaggregated").inc(4)
    proxy.requests.labels(endpoint="completions", path="error").inc(1)
    proxy.route.labels(path="split", reason="explore").inc(2)
    proxy.active.set(3)
    now = scrape(60.0, proxy, {"prefill[0]": engine_text(2, 1, 0.5, nixl_bytes=4e6),
                               "decode[0]": engine_text(3, 4, 0.75)},
                 health={"prefill[0]": 200, "decode[0]": 503})

    snap = build_snapshot("house", "http://127.0.0.1:8000", PROCS, now, previous, base)
    assert snap.window == "last 60 s" and snap.rate_interval_s == 2.0
    assert snap.ttft.count == 5
    assert 0.1 < snap.ttft.p50 < 0.2      # type: ignore[operator]  # the 5 s answers before the window are out
    assert 0.75 < snap.ttft.p99 <= 1.0    # type: ignore[operator]
    assert snap.tpot.count == 3 and 0.015 < snap.tpot.p50 < 0.025  # type: ignore[operator]
    assert snap.requests_per_s == pytest.approx(5 / 2)
    assert snap.decisions_per_s == pytest.approx(2 / 2)
    assert snap.routes == {"split": 5.0, "local": 1.0}
    assert snap.route_reasons == {"local/predicted": 1.0, "split/explore": 2.0, "split/predicted": 3.0}
    assert snap.fallbacks == {"timeout": 1.0}
    assert snap.errors == {"error requests": 1.0, "upstream prefill/timeout": 1.0}
    assert snap.active_requests == 3.0
    assert snap.handoff_bytes_per_s == pytest.approx(2e6 / 2)   # decode exported no counter before
    prefill, decode = snap.engines
    assert (prefill.role, prefill.host, prefill.healthy, prefill.running, prefill.waiting, prefill.kv_use) == \
        ("prefill", "gpu-box", True, 2.0, 1.0, 0.5)
    assert (decode.role, decode.status, decode.restarts, decode.healthy, decode.kv_use) == \
        ("decode", "backoff", 2, False, 0.75)


def test_once_reports_since_start_and_json_says_so() -> None:
    proxy = ProxyMetrics()
    proxy.ttft.observe(0.3)
    proxy.route.labels(path="whole", reason="decode_backlog").inc()
    first = scrape(10.0, proxy, {"prefill[0]": engine_text(0, 0, 0.0, socket_bytes=100.0)})
    second = scrape(11.0, proxy, {"prefill[0]": engine_text(0, 0, 0.0, socket_bytes=600.0)})
    snap = build_snapshot("r", "http://p", PROCS[:1], second, first, None)
    assert snap.window == "since the proxy started"
    assert snap.ttft.count == 1 and snap.routes == {"whole": 1.0}
    assert snap.handoff_bytes_per_s == pytest.approx(500.0)
    data = snap.to_json()
    assert data["window"] == {"description": "since the proxy started", "seconds": None}
    assert data["rates"]["interval_s"] == 1.0 and data["rates"]["decisions_per_s"] == 0.0
    assert data["ttft_s"]["count"] == 1 and data["proxy"]["up"] is True
    assert data["engines"][0]["name"] == "prefill[0]" and data["engines"][0]["kv_use"] == 0.0


def test_a_restarted_proxy_counts_from_its_restart() -> None:
    before = ProxyMetrics()
    for _ in range(10):
        before.ttft.observe(4.0)
    before.route.labels(path="split", reason="predicted").inc(10)
    after = ProxyMetrics()              # a new process: every counter from zero
    after.ttft.observe(0.2)
    after.route.labels(path="split", reason="predicted").inc(1)
    old, new = scrape(0.0, before, {}), scrape(1.0, after, {})
    snap = build_snapshot("r", "http://p", [], new, old, old)
    assert snap.ttft.count == 1 and snap.ttft.p50 is not None and snap.ttft.p50 < 0.3
    assert snap.routes == {"split": 1.0}
    assert snap.decisions_per_s == 1.0


def test_what_did_not_answer_reads_as_unknown() -> None:
    now = scrape(1.0, None, {"prefill[0]": None}, health={"prefill[0]": None})
    snap = build_snapshot("r", "http://p", PROCS[:1], now, scrape(0.0, None, {"prefill[0]": None}), None)
    assert snap.proxy_error == "connection refused"
    assert snap.requests_per_s is None and snap.ttft.count == 0 and snap.handoff_bytes_per_s is None
    row = snap.engines[0]
    assert (row.healthy, row.running, row.waiting, row.kv_use) == (None, None, None, None)


def test_older_vllm_kv_name_and_engines_without_vllm_metrics() -> None:
    text = engine_text(1, 0, 0.4, kv_name="vllm:gpu_cache_usage_perc")
    now = scrape(0.0, None, {"prefill[0]": text, "decode[0]": "# TYPE other gauge\nother 1\n"})
    snap = build_snapshot("r", "http://p", PROCS, now)
    assert snap.engines[0].kv_use == 0.4
    assert (snap.engines[1].running, snap.engines[1].kv_use) == (None, None)
    assert snap.rate_interval_s is None and snap.requests_per_s is None


def test_hostile_metrics_text_is_an_error_not_a_traceback() -> None:
    for bad in ("{{{", 'x{le="1"} not-a-number\n', "<html>Bad Gateway</html>\n"):
        with pytest.raises(MetricsError, match="not Prometheus text"):
            Metrics.parse(bad)
        with pytest.raises(MetricsError):
            exported_names(bad)


def test_exported_names_include_declared_families_without_samples() -> None:
    names = exported_names(ProxyMetrics().render().decode())
    # labelled counters nobody incremented export no sample, only their declaration
    assert {"disagg_route_total", "disagg_proxy_fallbacks_total", "disagg_proxy_ttft_seconds_bucket",
            "disagg_proxy_ttft_seconds_count", "disagg_proxy_active_requests"} <= names
    assert "disagg_route_bucket" not in names
