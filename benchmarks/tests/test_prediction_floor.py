"""benchmarks/prediction_floor.py reads the router's own debug lines, and its oracle is the best constant."""

from __future__ import annotations

import logging
import time

import pytest

from benchmarks.prediction_floor import oracle_mae, parse, report
from disagg.proxy.backends import BackendPool
from disagg.proxy.config import RoutingConfig
from disagg.proxy.metrics import ProxyMetrics
from disagg.proxy.router import Router
from disagg.proxy.routes import COMPLETIONS, GenerationRequest, PromptRoute, RequestPlan, RoutePath


def test_it_parses_the_lines_a_real_router_logs(caplog: pytest.LogCaptureFixture) -> None:
    """The load of the engine that computed each prompt (the one the decision chose, among two
    decode engines), its queue, and the observed and predicted times, from a real router's lines."""
    metrics = ProxyMetrics()
    prefill = BackendPool("prefill", ["http://p:1"], metrics)
    decode = BackendPool("decode", ["http://d:1", "http://d:2"], metrics)
    for pool in (prefill, decode):
        for b in pool.backends:
            pool.mark_up(b)
    decode.backends[0].outstanding, decode.backends[1].outstanding = 1, 3
    router = Router(RoutingConfig(policy="auto", kv_bytes_per_token=1024.0, prefill_tokens_per_s=2000.0,
                                  link_bytes_per_s=1e9, handoff_fixed_s=0.03), prefill, decode, metrics, local=True)
    expected = []
    routes = []
    with caplog.at_level(logging.DEBUG, logger="disagg.proxy"):
        for i in range(3):      # 1,000 tokens each: half a second of queue at the seed's 2,000 tokens/s
            req = GenerationRequest(COMPLETIONS, {"prompt": "x" * 4000, "stream": True}, b"{}", {}, f"req-{i}")
            route = PromptRoute(0, req, RoutePath.SPLIT)
            router.route(RequestPlan(req, [route]))
            engine = route.decode if route.path is RoutePath.LOCAL else route.prefill
            assert engine is not None
            queued = router.measurements.queued_tokens(engine.role, engine.url) > 0
            expected.append((route.path.value, 1000, engine.outstanding, queued))
            router.sent(route, stream=True, now=time.perf_counter())
            routes.append(route)
        for route, seconds in zip(routes, (0.6, 1.1, 1.7), strict=True):
            router.first_token(route, seconds)
            router.finished(route)
    assert any(q for *_, q in expected), "a prompt was decided with work queued on its engine"
    prompts = parse(caplog.messages)
    assert [(p.path, p.tokens, p.in_flight, p.queued) for p in prompts] == expected
    assert [p.observed_ms for p in prompts] == pytest.approx([600.0, 1100.0, 1700.0])
    assert [p.predicted_ms for p in prompts] == pytest.approx([1e3 * r.predicted_s for r in routes], abs=0.1)
    path, _, in_flight, queued = expected[0]
    assert f"| {path} | 1024 | {in_flight} | {'yes' if queued else 'no'} |" in report(prompts * 4, [64, 1024])


def test_the_oracle_is_the_constant_with_the_least_relative_error() -> None:
    observed = [60.0, 80.0, 100.0, 300.0]
    best = oracle_mae(observed)
    grid = [c / 10 for c in range(100, 4000)]
    assert best == pytest.approx(min(sum(abs(c - o) / o for o in observed) / 4 for c in grid), abs=1e-3)
    assert oracle_mae([50.0] * 5) == 0.0
