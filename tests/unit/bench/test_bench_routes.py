"""disagg.bench.routes: the proxy's route mix and prediction quality from /metrics deltas, read
from pages the proxy's own ProxyMetrics renders (so a renamed series breaks these tests), and
the route scrape around each run of a sweep against the stand-in (see conftest.py)."""

from __future__ import annotations

import aiohttp
import pytest

from disagg.bench.routes import merge_deltas, parse_route_counters, route_delta, route_summary, scrape
from disagg.bench.runner import Step, Target, run_sweep
from disagg.bench.workload import Workload, parse_classes
from disagg.proxy.metrics import ProxyMetrics


def _page(m: ProxyMetrics) -> str:
    return m.render().decode()


def test_deltas_between_two_pages() -> None:
    m = ProxyMetrics()
    m.route.labels(path="local", reason="predicted").inc(3)
    m.route_predicted.labels(path="local").observe(0.010)
    m.route_observed.labels(path="local").observe(0.020)
    before = parse_route_counters(_page(m))
    assert before.routes == {("local", "predicted"): 3.0}
    assert before.predicted == {"local": pytest.approx((0.010, 1.0))}
    m.route.labels(path="local", reason="predicted").inc(1)
    m.route.labels(path="split", reason="predicted").inc(2)
    m.route.labels(path="split", reason="decode_backlog").inc(1)
    m.route_predicted.labels(path="local").observe(0.030)
    m.route_observed.labels(path="local").observe(0.020)
    for observed in (0.125, 0.080, 0.125):   # per prompt |100 - obs| / obs: 0.2, 0.25, 0.2
        m.route_predicted.labels(path="split").observe(0.100)
        m.route_observed.labels(path="split").observe(observed)
        m.route_error.labels(path="split").observe(abs(0.100 - observed) / observed)
    m.requests.labels(endpoint="completions", path="split").inc(5)     # other series are ignored
    delta = route_delta(before, parse_route_counters(_page(m)))
    assert delta is not None
    assert delta["routes"] == {"local": {"predicted": 1.0}, "split": {"decode_backlog": 1.0, "predicted": 2.0}}
    assert delta["predicted_ttft"]["local"] == {"sum_s": pytest.approx(0.030), "count": 1.0}
    summary = route_summary(delta)
    assert summary["local"]["share"] == pytest.approx(0.25) and summary["split"]["share"] == pytest.approx(0.75)
    assert summary["split"]["prompts"] == 3.0
    assert summary["split"]["predicted_ttft_ms"] == pytest.approx(100.0)
    assert summary["split"]["observed_ttft_ms"] == pytest.approx(110.0)
    assert summary["split"]["relative_error"] == pytest.approx(100 / 110 - 1)
    # the mean of the per-prompt errors, not the error of the means (which hides errors of both signs)
    assert summary["split"]["mean_abs_error"] == pytest.approx((0.2 + 0.25 + 0.2) / 3)
    assert summary["local"]["mean_abs_error"] is None     # the page had no error sample for local
    assert summary["local"]["relative_error"] == pytest.approx(0.5)       # 30 ms predicted, 20 observed


def test_no_routing_series_and_restarts() -> None:
    assert parse_route_counters("# nothing\n").empty
    assert route_delta(None, None) is None
    m = ProxyMetrics()
    m.route.labels(path="local", reason="predicted").inc(5)
    high = parse_route_counters(_page(m))
    fresh = ProxyMetrics()                      # the proxy restarted: counters start again from zero
    fresh.route.labels(path="local", reason="predicted").inc(2)
    delta = route_delta(high, parse_route_counters(_page(fresh)))
    assert delta is not None and delta["routes"] == {"local": {"predicted": 2.0}}
    merged = merge_deltas([delta, None, delta])
    assert merged is not None and merged["routes"] == {"local": {"predicted": 4.0}}
    assert merge_deltas([None, None]) is None
    summary = route_summary(merged)
    assert summary["local"]["predicted_ttft_ms"] is None and summary["local"]["relative_error"] is None


async def test_scrape_is_silent_without_the_series(standin) -> None:
    async with aiohttp.ClientSession() as s:
        assert await scrape(s, standin.url) is None                 # /metrics is 404
        standin.routes = ProxyMetrics()
        assert await scrape(s, standin.url) is None                 # a page, but no route sample yet
        standin.routes.route.labels(path="split", reason="policy").inc()
        found = await scrape(s, standin.url)
        assert found is not None and found.routes == {("split", "policy"): 1.0}
        assert await scrape(s, "http://127.0.0.1:9") is None        # nothing listening


async def test_sweep_records_the_route_mix_of_each_run(standin) -> None:
    standin.routes = ProxyMetrics()
    standin.split_from = 100                    # short (40 tokens) local, long (400) split
    w = Workload(parse_classes("short=40,long=400", output_len=3), num_requests=6, seed=2)
    result = await run_sweep(Target(standin.url), w, [Step(rate=200.0), Step(rate=400.0)], progress=False,
                             repeats=2)
    assert len(result.runs) == 4
    for run in result.runs:
        assert run.routes is not None
        by_class = {k: run.metrics[k].completed for k in ("short", "long")}
        # exactly this run's prompts: the warm-up and the other runs are not counted
        assert run.routes["routes"] == {"local": {"predicted": by_class["short"]},
                                        "split": {"predicted": by_class["long"]}}
        summary = route_summary(run.routes)
        assert summary["split"]["relative_error"] == pytest.approx(0.5)
        assert summary["local"]["observed_ttft_ms"] < summary["split"]["observed_ttft_ms"]
    assert "routes" in result.runs[0].to_dict()


async def test_sweep_without_metrics_has_no_routes(standin) -> None:
    w = Workload(parse_classes("short=40", output_len=2), num_requests=2, seed=2)
    result = await run_sweep(Target(standin.url), w, [Step(rate=100.0)], progress=False)
    assert result.runs[0].routes is None and "routes" not in result.runs[0].to_dict()
