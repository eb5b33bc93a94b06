"""Live measurements (disagg.proxy.measure), the prompt-length estimate (disagg.proxy.promptlen)
and the router that joins them to the policy (disagg.proxy.router)."""

from __future__ import annotations

from pathlib import Path

import pytest

from disagg.modelgen import build_model
from disagg.prometheus_text import sample_sum
from disagg.prompts import exact_prompt, load_tokenizer
from disagg.proxy.backends import BackendPool
from disagg.proxy.config import RoutingConfig
from disagg.proxy.measure import EwFit, Measurements
from disagg.proxy.metrics import ProxyMetrics
from disagg.proxy.promptlen import SAMPLE_CHARS, PromptLength
from disagg.proxy.router import Router
from disagg.proxy.routes import COMPLETIONS, GenerationRequest, PromptRoute, RequestPlan, RoutePath


def test_fit_recovers_a_line_and_follows_change() -> None:
    seed_rate, seed_a = 1000.0, 0.0
    fit = EwFit(seed_a, seed_rate, (128.0, 2048.0))
    assert fit.coefficients() == pytest.approx((seed_a, seed_rate))
    true_a, true_rate = 0.012, 2500.0
    for i in range(40):
        n = 100 + 97 * (i % 13)
        fit.add(n, true_a + n / true_rate)
    a, rate = fit.coefficients()
    assert a == pytest.approx(true_a, rel=0.05) and rate == pytest.approx(true_rate, rel=0.05)
    # the engine gets twice as slow: within a few dozen samples the fit says so
    for i in range(30):
        n = 100 + 97 * (i % 13)
        fit.add(n, true_a + 2 * n / true_rate)
    assert fit.coefficients()[1] == pytest.approx(true_rate / 2, rel=0.05)


def test_fit_with_one_prompt_length_keeps_its_intercept() -> None:
    fit = EwFit(0.005, 1000.0, (128.0, 2048.0))
    for _ in range(50):
        fit.add(500.0, 0.005 + 500 / 4000)
    a, rate = fit.coefficients()
    assert a == pytest.approx(0.005, rel=0.05) and rate == pytest.approx(4000.0, rel=0.05)
    fit.add(float("nan"), 1.0)
    fit.add(-1.0, 1.0)
    assert fit.coefficients() == pytest.approx((a, rate))


def measurements() -> Measurements:
    return Measurements(prefill_tokens_per_s=4000.0, decode_tokens_per_s=2000.0, overhead_s=0.0,
                        handoff_fixed_s=0.03, link_bytes_per_s=1e9)


def test_queue_counts_pending_prefills_until_settled_or_expired() -> None:
    m = measurements()
    first = m.dispatch("decode", "d", 300.0)
    m.dispatch("decode", "d", 200.0, until=5.0)
    assert m.queued_tokens("decode", "d", now=1.0) == 500.0
    assert m.queued_tokens("decode", "d", now=6.0) == 300.0
    cost = m.engine_cost("decode", "d", outstanding=3)
    assert (cost.queued_tokens, cost.running) == (300.0, 2)
    m.settle("decode", "d", first)
    assert m.queued_tokens("decode", "d") == 0.0


def test_seeds_then_observations_per_engine_and_pair_and_forget() -> None:
    m = measurements()
    assert m.engine_cost("prefill", "p", 0).tokens_per_s == pytest.approx(4000.0)
    assert m.engine_cost("decode", "d", 0).tokens_per_s == pytest.approx(2000.0)
    assert m.link_cost("p", "d").fixed_s == pytest.approx(0.03)
    for i in range(30):
        nbytes = (1 + i % 7) * 4e6
        m.observe_handoff("p", "d", nbytes, 0.01 + nbytes / 2e8)
        m.observe_prefill("decode", "d", 100 + 50 * (i % 7), 0.002 + (100 + 50 * (i % 7)) / 500)
    link = m.link_cost("p", "d")
    # what is left of the seed after 30 samples weighs a little on the far end of the line
    assert link.fixed_s == pytest.approx(0.01, rel=0.2) and link.bytes_per_s == pytest.approx(2e8, rel=0.05)
    assert m.engine_cost("decode", "d", 0).tokens_per_s == pytest.approx(500.0, rel=0.05)
    assert m.samples("d") == 30
    # an engine not measured yet takes the measured per-request overhead, and its seeded rate
    # scaled as the measured engine's fell from its seed (here 2000 -> 500: a quarter)
    measured = m.engine_cost("decode", "d", 0)
    unseen = m.engine_cost("prefill", "p2", 0)
    assert unseen.overhead_s == pytest.approx(measured.overhead_s)
    assert unseen.tokens_per_s == pytest.approx(4000.0 * measured.tokens_per_s / 2000.0)
    m.forget("d")
    assert m.samples("d") == 0
    assert m.engine_cost("decode", "d", 0).tokens_per_s == pytest.approx(2000.0)
    assert m.link_cost("p", "d").fixed_s == pytest.approx(0.03)


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model("tiny", tmp_path_factory.mktemp("m") / "tiny") / "tokenizer.json"


def test_prompt_length_exact_with_the_tokenizer(tokenizer_json: Path) -> None:
    tok = load_tokenizer(tokenizer_json.parent)
    lengths = PromptLength(str(tokenizer_json))
    assert lengths.exact
    for n in (1, 50, 300):
        prompt = exact_prompt(tok, n, f"t{n}")
        assert len(prompt) <= SAMPLE_CHARS
        assert lengths.tokens({"prompt": prompt}, chat=False) == len(tok.encode(prompt).ids)
    for n in (1000, 2000, 4000):   # longer prompts are sampled: within 10% (the benchmark reports it)
        prompt = exact_prompt(tok, n, f"t{n}")
        assert lengths.tokens({"prompt": prompt}, chat=False) == pytest.approx(len(tok.encode(prompt).ids), rel=0.1)
    assert lengths.tokens({"prompt": [5, 6, 7]}, chat=False) == 3


def test_prompt_length_from_characters_learns_the_ratio(tokenizer_json: Path) -> None:
    tok = load_tokenizer(tokenizer_json.parent)
    lengths = PromptLength(None, chars_per_token=4.0)
    assert not lengths.exact
    prompts = [exact_prompt(tok, 100 + 37 * i, f"c{i}") for i in range(40)]
    for p in prompts:
        lengths.calibrate(lengths.tokens({"prompt": p}, chat=False), len(tok.encode(p).ids), chat=False)
    # after calibration the estimate is within 10% of the engine's count on prompts it has not seen
    for i in range(3):
        p = exact_prompt(tok, 1500 + i, f"new{i}")
        counted = len(tok.encode(p).ids)
        assert abs(lengths.tokens({"prompt": p}, chat=False) - counted) / counted < 0.10
    assert lengths.error is not None and lengths.error < 0.5
    assert PromptLength(str(tokenizer_json.parent / "missing.json")).exact is False


def _route(prompt: str, index: int = 0) -> PromptRoute:
    req = GenerationRequest(COMPLETIONS, {"prompt": prompt, "stream": True}, b"{}", {}, f"r{index}")
    return PromptRoute(index, req, RoutePath.SPLIT)


def test_router_decides_counts_and_forgets_a_returned_engine() -> None:
    metrics = ProxyMetrics()
    prefill, decode = BackendPool("prefill", ["http://p:1"], metrics), BackendPool("decode", ["http://d:1"], metrics)
    for pool in (prefill, decode):
        pool.mark_up(pool.backends[0])
    config = RoutingConfig(policy="auto", kv_bytes_per_token=1024.0, prefill_tokens_per_s=2000.0,
                           link_bytes_per_s=1e9, handoff_fixed_s=0.03)
    router = Router(config, prefill, decode, metrics, local=True)
    route = _route("x" * 400)
    router.route(RequestPlan(route.request, [route]))
    assert (route.path, route.reason, route.decode) == (RoutePath.LOCAL, "predicted", decode.backends[0])
    assert route.tokens == 100 and route.predicted_s == pytest.approx(100 / 2000)
    text = metrics.render().decode()
    assert sample_sum(text, "disagg_route_total", path="local", reason="predicted") == 1
    # the decode engine turns out 10x slower than seeded: what is measured routes the next prompts
    d = decode.backends[0]
    paths = []
    for i in range(20):
        r = _route("y" * 400, i)
        router.route(RequestPlan(r.request, [r]))
        paths.append(r.path)
        router.sent(r, stream=True, now=0.0)
        if r.path is RoutePath.LOCAL:
            router.first_token(r, 0.0, r.tokens / 200.0)
        router.finished(r)
    assert paths[0] is RoutePath.LOCAL and paths[-1] is RoutePath.SPLIT
    # (one prompt length: the fit cannot tell overhead from rate, but predicts that length's TTFT)
    assert router.measurements.engine_cost("decode", d.url, 0).ttft_s(100) > 2 * 100 / 2000.0
    # a restarted engine: back to the seed
    decode.mark_down(d, "gone")
    decode.mark_up(d)
    assert router.measurements.samples(d.url) == 0
    assert router.measurements.engine_cost("decode", d.url, 0).tokens_per_s == pytest.approx(2000.0)


def test_router_static_split_leaves_routes_to_the_handoff() -> None:
    metrics = ProxyMetrics()
    prefill, decode = BackendPool("prefill", ["http://p:1"], metrics), BackendPool("decode", ["http://d:1"], metrics)
    router = Router(RoutingConfig(), prefill, decode, metrics, local=True)
    routes = [_route("a", 0), _route("b", 1)]
    routes.append(PromptRoute(2, routes[0].request, RoutePath.LOCAL, "n"))
    router.route(RequestPlan(routes[0].request, routes))
    assert [(r.path, r.reason, r.prefill, r.decode, r.tokens) for r in routes] == [
        (RoutePath.SPLIT, "policy", None, None, 0), (RoutePath.SPLIT, "policy", None, None, 0),
        (RoutePath.LOCAL, "n", None, None, 0)]
    text = metrics.render().decode()
    assert sample_sum(text, "disagg_route_total", path="split", reason="policy") == 2
    assert sample_sum(text, "disagg_route_total", path="local", reason="n") == 1
