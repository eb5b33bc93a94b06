"""Live measurements (disagg.proxy.measure), the prompt-length estimate (disagg.proxy.promptlen)
and the router that joins them to the policy (disagg.proxy.router)."""

from __future__ import annotations

import math
import time
from dataclasses import replace
from itertools import pairwise
from pathlib import Path

import pytest

from disagg.modelgen import build_model
from disagg.prometheus_text import sample_sum
from disagg.prompts import exact_prompt, load_tokenizer
from disagg.proxy.backends import BackendPool
from disagg.proxy.config import RoutingConfig
from disagg.proxy.measure import (
    CLIP,
    DUTY_WINDOW_S,
    MAX_DUTY,
    MIN_STEP_SHARE,
    SEED_SAMPLES,
    EwFit,
    Measurements,
    PrefillWork,
)
from disagg.proxy.metrics import ProxyMetrics
from disagg.proxy.policy import Candidate, Explorer, decide
from disagg.proxy.promptlen import SAMPLE_CHARS, PromptLength
from disagg.proxy.router import MIN_DECODE_EVENTS, Router, expected_output_tokens
from disagg.proxy.routes import COMPLETIONS, GenerationRequest, PromptRoute, RequestPlan, RoutePath
from disagg.routecost import EngineCost, LinkCost, Option, local_ttft, split_ttft, stall_s


def test_fit_recovers_a_line_and_follows_change() -> None:
    seed_rate, seed_a = 1000.0, 0.0
    fit = EwFit(seed_a, seed_rate, (128.0, 2048.0), warmup=0)
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
    assert fit.add(float("nan"), 1.0) == "invalid" and fit.add(-1.0, 1.0) == "invalid"
    assert fit.coefficients() == pytest.approx((a, rate))


# --- robust to one-off costs: warm-up discard and upward clipping ----------------------------

KV_PER_TOKEN = 32 * 1024.0
#: a prefill engine twice the decode engine's speed, a 10 Gb/s link (a token's KV in 26 us)
FAST_P, SLOW_D = EngineCost(tokens_per_s=4000.0), EngineCost(tokens_per_s=2000.0)
TRUE_FIXED, TRUE_LINK = 0.016, 1.25e9
N = 400                                        # a prompt that the seeds and the real link both split


def handoff_s(nbytes: float, slower: float = 1.0) -> float:
    return slower * (TRUE_FIXED + nbytes / TRUE_LINK)


def path_with(link: LinkCost, n: int = N) -> Option:
    return decide("auto", n, n * KV_PER_TOKEN, [Candidate("P", FAST_P)], [Candidate("D", SLOW_D)],
                  lambda _p, _d: link).path


def link_of(fit: EwFit) -> LinkCost:
    fixed, rate = fit.coefficients()
    return LinkCost(fixed_s=fixed, bytes_per_s=rate)


def test_a_prefill_line_from_prompts_of_alike_sizes_keeps_a_small_intercept() -> None:
    """Local prompts of 256-509 tokens only, noisy (as on a slow core, where the policy split the
    short ones): the engine's line keeps its small intercept and passes through their mean, so a
    short prompt is priced near its real time and a long one near the line, where a free fit
    extrapolated an intercept of almost half a second."""
    true_a, true_rate = 0.03, 220.0
    sizes = (256.0, 384.0, 509.0, 448.0, 256.0, 509.0, 384.0, 448.0)
    noise = (1.15, 0.95, 1.1, 0.9, 1.2, 0.92, 1.05, 1.12)
    m = Measurements(prefill_tokens_per_s=1000.0, decode_tokens_per_s=1000.0, overhead_s=0.02,
                     handoff_fixed_s=0.03, link_bytes_per_s=1e9)
    free = EwFit(0.02, 1000.0, (128.0, 2048.0))
    for size, factor in ((8.0, 1.0), *zip(sizes, noise, strict=True)):    # the first: a warm-up, dropped
        m.observe_prefill("decode", "d", size, factor * (true_a + size / true_rate))
        free.add(size, factor * (true_a + size / true_rate))
    cost = m.engine_cost("decode", "d", 0)
    assert cost.prefill_s(8) < 0.1                      # 8 tokens take 66 ms on the true line
    assert cost.prefill_s(2048) == pytest.approx(true_a + 2048 / true_rate, rel=0.15)
    # the free fit (spread threshold 0.05): an intercept of 0.46 s, 8 tokens priced at 7 x their time
    assert free.predict(8) > 5 * (true_a + 8 / true_rate)


def test_a_prefill_line_keeps_its_seeds_overhead_while_seeded_and_takes_its_rate_from_the_samples() -> None:
    """A decode engine seeded at 1,000 tokens/s prefills at 160: its first sample (after the warm-up
    one) is a 256-token prompt. Its line keeps the seed's overhead, so an 8-token prompt is not
    priced at half a second (a least-squares line through the seed's points and the sample had
    482 ms), and takes the sample's rate, not one near the seed's."""
    m = Measurements(prefill_tokens_per_s=1000.0, decode_tokens_per_s=1000.0, overhead_s=0.0,
                     handoff_fixed_s=0.03, link_bytes_per_s=1e9)
    m.observe_prefill("decode", "d", 8.0, 0.058)          # the warm-up sample, dropped
    m.observe_prefill("decode", "d", 256.0, 0.03 + 256 / 160)
    cost = m.engine_cost("decode", "d", 0)
    assert cost.overhead_s == 0.0 and cost.prefill_s(8) < 0.06
    assert cost.tokens_per_s == pytest.approx(256 / (0.03 + 256 / 160))
    free = EwFit(0.0, 1000.0, (128.0, 2048.0), warmup=0)  # the same without the seed's overhead kept
    free.add(256.0, 0.03 + 256 / 160)
    assert free.predict(8) > 0.4


def test_an_outlier_first_handoff_does_not_stop_splits() -> None:
    """The CI case: the first handoff of a pair pays a handshake (here 1 s, 40x the steady cost);
    seeds and every later sample say split. Robust: split throughout. At face value (no warm-up
    discard, no clipping): the first sample alone flips the decision to local."""
    assert path_with(LinkCost(TRUE_FIXED, TRUE_LINK)) is Option.SPLIT
    sizes = [N * KV_PER_TOKEN * f for f in (1.0, 0.5, 2.0, 1.5, 0.75, 1.25, 1.0, 0.6)]
    robust = EwFit(0.03, 1e9, (1 << 20, 64 << 20))
    naive = EwFit(0.03, 1e9, (1 << 20, 64 << 20), warmup=0, clip=float("inf"))
    assert path_with(link_of(robust)) is Option.SPLIT
    paths_robust, paths_naive = [], []
    for i, nbytes in enumerate(sizes):
        seconds = 1.0 if i == 0 else handoff_s(nbytes)
        assert robust.add(nbytes, seconds) == ("discarded" if i == 0 else "used")
        naive.add(nbytes, seconds)
        paths_robust.append(path_with(link_of(robust)))
        paths_naive.append(path_with(link_of(naive)))
    assert paths_robust == [Option.SPLIT] * len(sizes)
    assert paths_naive[0] is Option.LOCAL
    assert robust.samples == len(sizes) - 1 and robust.discarded == 1
    fixed, rate = robust.coefficients()
    assert fixed == pytest.approx(TRUE_FIXED, rel=0.05) and rate == pytest.approx(TRUE_LINK, rel=0.05)


def test_a_later_outlier_is_clipped_a_repeated_slow_down_still_moves_the_estimate() -> None:
    def established() -> tuple[EwFit, EwFit]:
        robust, naive = EwFit(0.03, 1e9, (1 << 20, 64 << 20)), EwFit(0.03, 1e9, (1 << 20, 64 << 20), clip=1e9)
        for i in range(12):
            nbytes = N * KV_PER_TOKEN * (0.5 + 0.25 * (i % 5))
            robust.add(nbytes, handoff_s(nbytes))
            naive.add(nbytes, handoff_s(nbytes))
        return robust, naive

    nbytes = N * KV_PER_TOKEN
    robust, naive = established()
    assert robust.samples == 11 > SEED_SAMPLES and path_with(link_of(robust)) is Option.SPLIT
    before = robust.predict(nbytes)
    # one GC pause or stray handshake, 20x the usual handoff: entered as CLIP x the prediction
    assert robust.add(nbytes, 20 * handoff_s(nbytes)) == "clipped" and robust.clipped == 1
    naive.add(nbytes, 20 * handoff_s(nbytes))
    assert robust.predict(nbytes) < 1.5 * before
    assert path_with(link_of(robust)) is Option.SPLIT and path_with(link_of(naive)) is Option.LOCAL
    # a sample below the prediction is never clipped
    assert robust.add(nbytes, before / 10) == "used"

    # the link really gets 20x slower and stays so: the decision flips within a few samples and the
    # estimate keeps climbing towards the new cost
    robust, _ = established()
    paths, ratios = [], []
    for i in range(8):
        size = N * KV_PER_TOKEN * (0.5 + 0.25 * (i % 5))
        robust.add(size, handoff_s(size, slower=20))
        paths.append(path_with(link_of(robust)))
        ratios.append(robust.predict(nbytes) / handoff_s(nbytes))
    # (split wins by a margin worth 3.8x the handoff: the 4th slow sample crosses it)
    assert paths.index(Option.LOCAL) <= 3 and set(paths[3:]) == {Option.LOCAL}
    assert ratios[2] > 2.5 and ratios[-1] > 10.0
    assert all(b >= a for a, b in pairwise(ratios))
    assert robust.clipped >= 3 and CLIP * robust.predict(nbytes) > handoff_s(nbytes, slower=20)


def test_measurements_drop_each_fits_first_sample_again_after_forget() -> None:
    m = measurements()
    seeded = m.engine_cost("decode", "d", 0)
    assert m.observe_prefill("decode", "d", 300.0, 5.0) == "discarded"      # a cold engine's first prefill
    assert m.engine_cost("decode", "d", 0) == seeded and m.samples("d") == 0
    assert m.observe_prefill("decode", "d", 300.0, 300 / 1500) == "used"
    assert m.samples("d") == 1 and m.engine_cost("decode", "d", 0).ttft_s(300) > seeded.ttft_s(300)
    # per pair: a decode engine's own warm-up does not stand in for the pair's first handoff
    seeded_link = m.link_cost("p", "d")
    assert m.observe_handoff("p", "d", 1e7, 2.0) == "discarded" and m.link_cost("p", "d") == seeded_link
    assert m.observe_handoff("p2", "d", 1e7, 2.0) == "discarded"
    assert m.observe_handoff("p", "d", 1e7, 0.02) == "used"
    # the engine comes back (a new process): its fits and its pairs' start over, warm-up included
    m.forget("d")
    assert m.samples("d") == 0 and m.link_cost("p", "d") == seeded_link
    assert m.observe_prefill("decode", "d", 300.0, 5.0) == "discarded"
    assert m.observe_handoff("p", "d", 1e7, 2.0) == "discarded"


def measurements() -> Measurements:
    return Measurements(prefill_tokens_per_s=4000.0, decode_tokens_per_s=2000.0, overhead_s=0.0,
                        handoff_fixed_s=0.03, link_bytes_per_s=1e9)


def test_queue_counts_pending_prefills_until_settled_or_expired() -> None:
    m = measurements()
    first = m.dispatch("decode", "d", 300.0, now=100.0)
    m.dispatch("decode", "d", 200.0, until=105.0, now=100.0)
    assert m.queued_tokens("decode", "d", now=100.0) == 500.0
    assert m.queued_tokens("decode", "d", now=106.0) == 0.0   # expired; the first one's time is long past
    assert m.engine_cost("decode", "d", outstanding=3, now=106.0).running == 2
    m.settle("decode", "d", first)
    assert m.queued_tokens("decode", "d", now=106.0) == 0.0


def test_queue_counts_only_what_the_time_since_sending_has_not_covered() -> None:
    """A prompt that comes while a long prefill runs waits for what is left of it (FIFO at the
    engine's rate, 2,000 tokens/s seeded for decode), not for all of it."""
    m = measurements()
    long = m.dispatch("decode", "d", 2000.0, now=10.0)
    assert m.queued_tokens("decode", "d", now=10.0) == 2000.0
    assert m.queued_tokens("decode", "d", now=10.25) == pytest.approx(1500.0)
    m.dispatch("decode", "d", 400.0, now=10.5)              # queued behind the 1,000 tokens left
    assert m.queued_tokens("decode", "d", now=10.5) == pytest.approx(1400.0)
    cost = m.engine_cost("decode", "d", outstanding=2, now=10.75)
    assert cost.queued_tokens == pytest.approx(900.0) and cost.wait_s() == pytest.approx(0.45)
    assert m.queued_tokens("decode", "d", now=11.5) == pytest.approx(0.0)  # not settled: nothing left
    m.settle("decode", "d", long)
    m.dispatch("decode", "d", 100.0, now=20.0)             # idle since: its time is no progress
    assert m.queued_tokens("decode", "d", now=20.0) == 100.0
    assert m.queued_tokens("decode", "d", now=9.0) == 100.0  # a clock read earlier never adds work


def test_a_settled_prefill_took_the_time_up_to_its_first_token_and_only_itself_leaves() -> None:
    """The time up to a prefill's first token was spent on it (and on those sent before it), not
    on the prompts behind it; a failed or cancelled one just leaves, and of two prefills of one
    size the right one does."""
    m = measurements()
    a = m.dispatch("decode", "d", 2000.0, now=10.0)
    m.dispatch("decode", "d", 400.0, now=10.1)
    m.settle("decode", "d", a, now=11.0)                   # exactly when 2,000 tokens/s says
    assert m.queued_tokens("decode", "d", now=11.05) == pytest.approx(300.0)
    m2 = measurements()
    first = m2.dispatch("decode", "d", 500.0, now=0.0)
    second = m2.dispatch("decode", "d", 500.0, now=0.0)
    m2.settle("decode", "d", second, now=0.1, done=False)  # the client left: no time credited to it
    assert m2.queued_tokens("decode", "d", now=0.1) == pytest.approx(300.0)   # the first, 0.1 s in
    m2.settle("decode", "d", first, now=0.25)
    assert m2.queued_tokens("decode", "d", now=0.25) == 0.0 and m2.engine_cost("decode", "d", 0, now=0.25).waiting == 0


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
    assert m.samples("d") == 29      # the first, a warm-up, was dropped
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


def test_a_seed_measured_on_its_host_is_taken_as_it_is_and_scales_no_estimate() -> None:
    """Only estimated seeds are scaled by what live measurements say of the estimates: a prefill
    host's measured rate is not scaled by how far a decode host's estimate fell, and a measured
    seed's ratio (about 1) says nothing of an estimate."""
    m = Measurements(prefill_tokens_per_s=1000.0, decode_tokens_per_s=16000.0, overhead_s=0.0,
                     handoff_fixed_s=0.03, link_bytes_per_s=1e9, measured_rates=frozenset({"prefill"}))
    for i in range(12):                                  # the decode engine prefills 1,000 tokens/s, not 16,000
        n = 64.0 + 448 * (i % 2)
        m.observe_prefill("decode", "d", n, 0.020 + n / 1000)
    assert m.engine_cost("decode", "d", 0).tokens_per_s == pytest.approx(1000.0, rel=0.01)
    unseen = m.engine_cost("prefill", "p", 0)
    assert unseen.tokens_per_s == pytest.approx(1000.0)                # as measured, not 1000 / 16
    assert unseen.overhead_s == pytest.approx(0.020, abs=0.002)        # the measured engines' overhead
    for i in range(12):                                  # the prefill engine, measured, keeps its seed's rate
        n = 64.0 + 448 * (i % 2)
        m.observe_prefill("prefill", "p", n, 0.020 + n / 1000)
    # an estimated decode seed on a new engine: no engine seeded with an estimate but the first
    # decode engine is measured, so its ratio scales it; with only measured seeds measured, it stays
    assert m.engine_cost("decode", "d2", 0).tokens_per_s == pytest.approx(16000.0 / 16, rel=0.02)
    m.forget("d")
    assert m.engine_cost("decode", "d2", 0).tokens_per_s == pytest.approx(16000.0)


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


def _auto_pools() -> tuple[ProxyMetrics, BackendPool, BackendPool, RoutingConfig]:
    """One healthy prefill and one healthy decode engine, and auto routing seeded at 2,000 tokens/s."""
    metrics = ProxyMetrics()
    prefill, decode = BackendPool("prefill", ["http://p:1"], metrics), BackendPool("decode", ["http://d:1"], metrics)
    for pool in (prefill, decode):
        pool.mark_up(pool.backends[0])
    config = RoutingConfig(policy="auto", kv_bytes_per_token=1024.0, prefill_tokens_per_s=2000.0,
                           link_bytes_per_s=1e9, handoff_fixed_s=0.03)
    return metrics, prefill, decode, config


def test_router_decides_counts_and_forgets_a_returned_engine() -> None:
    metrics, prefill, decode, config = _auto_pools()
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
            router.first_token(r, r.tokens / 200.0)
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


def test_router_explores_a_path_not_taken_at_a_bounded_rate_and_counts_it() -> None:
    metrics, prefill, decode, config = _auto_pools()
    clock = [0.0]
    router = Router(config, prefill, decode, metrics, local=True, explorer=Explorer(after_s=60.0, after_decisions=50),
                    clock=lambda: clock[0])
    p, d = prefill.backends[0], decode.backends[0]
    # local 50 ms, split 80 ms (within 2x): local is predicted, split is the path not taken

    def serve(i: int) -> PromptRoute:
        r = _route("y" * 400, i)
        router.route(RequestPlan(r.request, [r]))
        router.sent(r, stream=True, now=0.0)
        if r.path is RoutePath.SPLIT:
            assert (r.prefill, r.decode) == (p, d)
            router.prefill_done(r, p, r.tokens / 2000.0, r.tokens)
            router.first_token(r, time.perf_counter() + 0.03)
        else:
            router.first_token(r, r.tokens / 2000.0)
        router.finished(r)
        return r

    def count(path: str, reason: str) -> float:
        return sample_sum(metrics.render().decode(), "disagg_route_total", path=path, reason=reason)

    served = []
    for i in range(80):                      # 80 decisions in 30 s: not long enough
        clock[0] = i * 30.0 / 80
        served.append(serve(i))
    assert {(r.path, r.reason) for r in served} == {(RoutePath.LOCAL, "predicted")}
    clock[0] = 61.0
    explored = serve(100)
    assert (explored.path, explored.reason) == (RoutePath.SPLIT, "explore")
    assert count("split", "explore") == 1 and count("local", "predicted") == 80
    assert explored.predicted_s == pytest.approx(100 / 2000 + 0.03 + 100 * 1024 / 1e9, rel=0.01)
    # its handoff reached the pair's fit (the pair's first: dropped as warm-up, and counted so)
    text = metrics.render().decode()
    assert sample_sum(text, "disagg_route_samples_total", fit="link", outcome="discarded") == 1
    # each engine's first prefill too: D's first local prompt, P's (the explored split's) prefill
    assert sample_sum(text, "disagg_route_samples_total", fit="engine", outcome="discarded") == 2
    assert sample_sum(text, "disagg_route_samples_total", fit="engine", outcome="used") == 79
    # fresh again: the next 50 decisions and 60 s go as predicted, then one more exploration
    again = []
    for i in range(70):
        clock[0] = 61.0 + i
        again.append(serve(200 + i))
    assert [i for i, r in enumerate(again) if r.reason == "explore"] == [60]      # at 121 s
    assert count("split", "explore") == 2
    assert sample_sum(metrics.render().decode(), "disagg_route_samples_total", fit="link", outcome="used") == 1


def test_static_policies_never_explore() -> None:
    clock = [0.0]
    for policy in ("split", "local"):
        metrics = ProxyMetrics()
        prefill = BackendPool("prefill", ["http://p:1"], metrics)
        decode = BackendPool("decode", ["http://d:1"], metrics)
        for pool in (prefill, decode):
            pool.mark_up(pool.backends[0])
        router = Router(RoutingConfig(policy=policy), prefill, decode, metrics, local=True,
                        explorer=Explorer(after_s=1.0, after_decisions=1), clock=lambda: clock[0])
        for i in range(20):
            clock[0] = 100.0 * i
            r = _route("z" * 400, i)
            router.route(RequestPlan(r.request, [r]))
            assert r.reason == "policy" and r.path is (RoutePath.SPLIT if policy == "split" else RoutePath.LOCAL)
        assert sample_sum(metrics.render().decode(), "disagg_route_total", reason="explore") == 0


def test_a_handoff_that_waited_for_the_decode_engines_queue_is_no_sample_of_the_link() -> None:
    """A split whose decode engine had its own prefills queued for most of the handoff when the
    prefill reply came measured that queue, not the link: counted ``decode_busy``, the link's fit
    untouched. A first token long before the queue's predicted end shows the estimate was off:
    that handoff is a sample."""
    metrics, prefill, decode, config = _auto_pools()
    router = Router(config, prefill, decode, metrics, local=True)
    p, d = prefill.backends[0], decode.backends[0]

    def split(i: int, queued_tokens: int) -> None:
        local = None
        if queued_tokens:   # a local prompt just sent to D (2,000 tokens/s seeded: 500 tokens = 0.25 s)
            local = PromptRoute(100 + i, _route("z", 100 + i).request, RoutePath.LOCAL, "predicted")
            local.decode, local.tokens = d, queued_tokens
            router.sent(local, stream=True)
        r = _route("y" * 400, i)
        r.reason, r.prefill, r.decode, r.tokens = "predicted", p, d, 100
        router.sent(r, stream=True)
        router.prefill_done(r, p, 0.05, 100)
        router.first_token(r, time.perf_counter() + 0.3)   # a 0.3 s handoff
        router.finished(r)
        if local is not None:
            router.finished(local)

    def samples(outcome: str) -> float:
        return sample_sum(metrics.render().decode(), "disagg_route_samples_total", fit="link", outcome=outcome)

    before = router.measurements.link_cost(p.url, d.url)
    for i in range(3):
        split(i, 500)                    # 0.25 s of D's own queue in a 0.3 s handoff
    assert samples("decode_busy") == 3 and samples("used") == 0 and samples("discarded") == 0
    assert router.measurements.link_cost(p.url, d.url) == before
    split(3, 0)
    split(4, 0)
    assert samples("discarded") == 1 and samples("used") == 1   # warm-up, then a sample of the link
    split(5, 20_000)                     # 10 s predicted, answered in 0.3 s: the estimate was off
    assert samples("used") == 2 and samples("decode_busy") == 3


def test_a_handoff_is_learned_at_the_decode_engines_load_when_its_split_was_sent() -> None:
    """The handoff's sample is taken at D's requests in flight when the split was sent, the load it
    was priced at: a handoff that leases D for its decode request beside the prefill (NIXL push,
    LMCache) has D's count one higher by the prefill's reply, and the sample must not count it."""
    metrics, prefill, decode, config = _auto_pools()
    router = Router(config, prefill, decode, metrics, local=True)
    p, d = prefill.backends[0], decode.backends[0]
    loads: list[int] = []
    router.measurements.observe_handoff = lambda p_url, d_url, nbytes, seconds, load=0: (  # type: ignore[method-assign]
        loads.append(load) or "used")
    r = _route("y" * 400, 0)
    r.reason, r.prefill, r.decode, r.tokens = "predicted", p, d, 100
    d.outstanding = 3                            # three requests decoding on D
    router.sent(r, stream=True)
    d.outstanding = 4                            # the handoff leased D for this one's decode request
    router.prefill_done(r, p, 0.05, 100)
    router.first_token(r, time.perf_counter() + 0.3)
    router.finished(r)
    assert loads == [3]


def test_a_prefill_sent_behind_a_queue_is_no_sample_of_the_engines_line() -> None:
    """Times measured behind a queue fitted as ``queued + tokens`` bent the line; such prefills
    (more than QUEUED_SHARE of their size queued ahead) are counted ``queued`` and left out."""
    m = measurements()
    assert m.observe_prefill("decode", "d", 100.0, 1.0) == "discarded"          # warm-up
    for _ in range(6):
        assert m.observe_prefill("decode", "d", 100.0, 0.06, queued_ahead=20.0) == "used"
    line = m.engine_cost("decode", "d", 0).ttft_s(100)
    # 4,000 tokens queued ahead, answered in 70 ms (the engine batched it): not a sample
    assert m.observe_prefill("decode", "d", 100.0, 0.07, queued_ahead=4000.0) == "queued"
    assert m.engine_cost("decode", "d", 0).ttft_s(100) == line
    assert line == pytest.approx(0.05)   # 100 of the 120 tokens each sample worked through in 60 ms


def test_exploration_off_never_explores_and_the_config_sets_the_explorer() -> None:
    """Eager exploration (after 0 s and 1 decision) re-measures the path not taken within a few
    prompts; the same with ``explore_within`` 0 (``routing.explore: off``) never does."""
    metrics, prefill, decode, config = _auto_pools()
    clock = [0.0]

    def reasons(within: float) -> list[str]:
        router = Router(replace(config, explore_within=within, explore_after_s=0.0, explore_decisions=1), prefill,
                        decode, metrics, local=True, clock=lambda: clock[0])
        out = []
        for i in range(10):
            clock[0] += 10.0
            r = _route("y" * 400, i)
            router.route(RequestPlan(r.request, [r]))
            out.append(r.reason)
        return out

    assert "explore" in reasons(2.0)
    assert set(reasons(0.0)) == {"predicted"}


def test_a_streamed_handoff_is_priced_streamed_and_learns_its_fixed_cost_not_the_links_rate() -> None:
    """With ``streaming_layers`` (``vllm-socket-stream``) a split is predicted with the part of the
    transfer the prefill does not hide, and its prefill answer -> first token time, which overlaps
    the prefill (decode may even answer first), is no sample of the link: the link's rate stays at
    its seed. What each first token took beyond the prediction less the fixed cost is a sample of
    the fixed cost (``fit="handoff_fixed"``): 0.3 s beyond, every time, and the fixed cost becomes
    0.3 s. The prefill engine still learns from its answers."""
    metrics, prefill, decode, config = _auto_pools()
    config = replace(config, decode_tokens_per_s=200.0, streaming_layers=32)
    router = Router(config, prefill, decode, metrics, local=True)
    p, d = prefill.backends[0], decode.backends[0]
    seed = router.measurements.link_cost(p.url, d.url)
    assert (seed.fixed_s, seed.bytes_per_s, seed.streaming_layers) == (pytest.approx(0.03), pytest.approx(1e9), 32)

    def samples(fit: str, outcome: str | None = None) -> float:
        labels = {"fit": fit} if outcome is None else {"fit": fit, "outcome": outcome}
        return sample_sum(metrics.render().decode(), "disagg_route_samples_total", **labels)

    x = 100 * 1024 / 1e9          # 100 tokens' KV over the seeded 1 GB/s
    exposed = max(x / 32, x - 0.05 + 0.05 / 32)
    for i in range(8):
        r = _route("y" * 400, i)
        router.route(RequestPlan(r.request, [r]))
        assert (r.path, r.prefill, r.decode) == (RoutePath.SPLIT, p, d)
        if i == 0:     # 100 tokens: 50 ms of prefill hide all but a 32nd of the 0.1 ms transfer
            assert r.predicted_s == pytest.approx(100 / 2000 + 0.03 + exposed)
            assert r.predicted_s < 100 / 2000 + 0.03 + x
        router.sent(r, stream=True)
        arrival = r.notes.streamed_arrival
        assert arrival == pytest.approx(100 / 2000 + exposed)   # the prediction less the fixed cost
        sent = r.notes.sent
        if i % 2:      # decode's first token before prefill's answer
            router.first_token(r, sent + arrival + 0.3)
            router.prefill_done(r, p, 0.05, 100)
        else:          # prefill's answer, then decode's first token
            router.prefill_done(r, p, 0.05, 100)
            router.first_token(r, sent + arrival + 0.3)
        router.finished(r)
    assert samples("link") == 0
    learned = router.measurements.link_cost(p.url, d.url)
    assert (learned.bytes_per_s, learned.streaming_layers) == (seed.bytes_per_s, 32)
    assert learned.fixed_s == pytest.approx(0.3)       # the seed left after 4 samples; 7 of 0.3 s
    assert samples("handoff_fixed", "discarded") == 1 and samples("handoff_fixed", "used") == 7
    assert samples("engine", "discarded") == 1 and samples("engine", "used") == 7
    assert router.measurements.samples(p.url) == 7
    assert router.measurements.engine_cost("prefill", p.url, 0).queued_tokens == 0   # every prefill settled
    r = _route("y" * 400, 9)
    router.route(RequestPlan(r.request, [r]))
    assert r.predicted_s == pytest.approx(100 / 2000 + 0.3 + exposed)
    # forgotten with the engine: the seed again
    router._forget(d)
    assert router.measurements.link_cost(p.url, d.url).fixed_s == pytest.approx(0.03)


def test_a_streamed_split_behind_a_queue_is_no_sample_and_one_to_a_busy_decode_engine_teaches_that_load() -> None:
    """Sent behind a prefill queue on P (``queued``): no sample. Sent while D had requests in
    flight: a sample of the fixed cost at that load (the first token also waits for D's steps),
    so the line rises with D's load and the idle figure stays where the idle samples put it."""
    metrics, prefill, decode, config = _auto_pools()
    router = Router(replace(config, decode_tokens_per_s=200.0, streaming_layers=32), prefill, decode, metrics,
                    local=True)
    p, d = prefill.backends[0], decode.backends[0]
    before = router.measurements.link_cost(p.url, d.url)
    ahead = PromptRoute(100, _route("z", 100).request, RoutePath.SPLIT, "predicted")
    ahead.tokens, ahead.prefill, ahead.decode = 2000, p, d   # 1 s of work queued on P (2,000 tokens/s seeded)
    router.sent(ahead, stream=True)
    r = _route("y" * 400, 0)
    r.reason, r.prefill, r.decode, r.tokens = "predicted", p, d, 100
    router.sent(r, stream=True)
    router.first_token(r, r.notes.sent + 1.2)
    router.finished(r)
    router.finished(ahead)
    text = metrics.render().decode()
    assert sample_sum(text, "disagg_route_samples_total", fit="handoff_fixed", outcome="queued") == 1
    assert sample_sum(text, "disagg_route_samples_total", fit="handoff_fixed", outcome="discarded") == 0
    assert router.measurements.link_cost(p.url, d.url) == before

    for i in range(12):                         # 20 ms beyond at idle, 20 + 10 ms per request in flight
        load = (0, 2, 6)[i % 3]
        d.outstanding = load
        s = _route("y" * 400, 1 + i)
        s.reason, s.prefill, s.decode, s.tokens = "predicted", p, d, 100
        router.sent(s, stream=True)
        flight = s.notes
        router.first_token(s, flight.sent + flight.streamed_arrival + 0.020 + 0.010 * load)
        router.finished(s)
    d.outstanding = 0
    assert sample_sum(metrics.render().decode(), "disagg_route_samples_total", fit="handoff_fixed",
                      outcome="used") == 11
    assert router.measurements.link_cost(p.url, d.url).fixed_s == pytest.approx(0.020, abs=0.002)
    assert router.measurements.link_cost(p.url, d.url, 4).fixed_s == pytest.approx(0.060, abs=0.004)
    # the policy asks the line at the decode engine's load now
    d.outstanding = 6
    q = _route("y" * 400, 50)
    router.route(RequestPlan(q.request, [q]))
    split = router.measurements.link_cost(p.url, d.url, 6)
    assert q.path is RoutePath.SPLIT and split.fixed_s == pytest.approx(0.080, abs=0.006)
    assert q.predicted_s == pytest.approx(100 / 2000 + split.after_prefill_s(100 * 1024, 100 / 2000), rel=0.05)


def test_the_same_splits_without_streaming_sample_the_link() -> None:
    metrics, prefill, decode, config = _auto_pools()
    router = Router(replace(config, decode_tokens_per_s=200.0), prefill, decode, metrics, local=True)
    p, d = prefill.backends[0], decode.backends[0]
    assert router.measurements.link_cost(p.url, d.url).streaming_layers is None
    for i in range(3):
        r = _route("y" * 400, i)
        router.route(RequestPlan(r.request, [r]))
        assert r.path is RoutePath.SPLIT
        if i == 0:
            assert r.predicted_s == pytest.approx(100 / 2000 + 0.03 + 100 * 1024 / 1e9)
        router.sent(r, stream=True)
        router.prefill_done(r, p, 0.05, 100)
        router.first_token(r, time.perf_counter() + 0.3)
        router.finished(r)
    text = metrics.render().decode()
    assert sample_sum(text, "disagg_route_samples_total", fit="link", outcome="discarded") == 1
    assert sample_sum(text, "disagg_route_samples_total", fit="link", outcome="used") == 2


def test_handoffs_count_in_transit_from_the_prefill_reply_to_the_first_token_or_the_end() -> None:
    """A sequential split's handoff is on the link from its prefill reply to its first token; one
    that fails or is cancelled before its first token leaves at its end; a streamed split's from
    when it is sent; a reply not streamed (no first token seen) until its predicted end. An
    engine that comes back starts with none (what the policy makes of them:
    tests/unit/proxy/test_policy.py and tests/unit/test_routecost.py)."""
    metrics, prefill, decode, config = _auto_pools()
    router = Router(replace(config, decode_tokens_per_s=200.0), prefill, decode, metrics, local=True)
    m = router.measurements
    p, d = prefill.backends[0], decode.backends[0]

    def in_transit() -> int:
        return m.link_cost(p.url, d.url).in_transit

    def split(i: int) -> PromptRoute:
        r = _route("y" * 400, i)
        router.route(RequestPlan(r.request, [r]))
        assert (r.path, r.prefill, r.decode) == (RoutePath.SPLIT, p, d)
        router.sent(r, stream=True)
        return r

    first, second = split(0), split(1)
    assert in_transit() == 0                         # prefills running: nothing on the link yet
    router.prefill_done(first, p, 0.05, 100)
    router.prefill_done(second, p, 0.05, 100)
    assert in_transit() == 2
    idle_link = replace(m.link_cost(p.url, d.url), in_transit=0)
    router.first_token(first, time.perf_counter())
    assert in_transit() == 1
    router.finished(first)
    router.finished(second)                          # cancelled before its first token
    assert in_transit() == 0
    assert m.link_cost(p.url, d.url) == idle_link
    # an engine that comes back: its handoffs in transit went with it; a late end changes nothing
    third = split(3)
    router.prefill_done(third, p, 0.05, 100)
    assert in_transit() == 1
    router._forget(d)
    assert in_transit() == 0
    fourth = split(4)
    router.prefill_done(fourth, p, 0.05, 100)
    router.finished(third)                           # the old process's handoff: not this one
    assert in_transit() == 1
    router.finished(fourth)
    assert in_transit() == 0
    # a reply not streamed shows no first token: it counts until its handoff's predicted end
    quiet = _route("y" * 400, 6)
    router.route(RequestPlan(quiet.request, [quiet]))
    router.sent(quiet, stream=False)
    router.prefill_done(quiet, p, 0.05, 100)
    done_at = quiet.notes.prefill_done
    assert done_at is not None
    end = done_at + m.link_cost(p.url, d.url).seconds(100 * 1024.0)
    assert m.link_cost(p.url, d.url, now=end - 1e-6).in_transit == 1
    assert m.link_cost(p.url, d.url, now=end + 1e-6).in_transit == 0
    router.finished(quiet)                           # its end after that changes nothing
    assert in_transit() == 0
    # streamed: on the link from the send (the KV leaves as the prefill computes)
    streamed = Router(replace(config, decode_tokens_per_s=200.0, streaming_layers=8), prefill, decode,
                      ProxyMetrics(), local=True)
    r = _route("y" * 400, 5)
    streamed.route(RequestPlan(r.request, [r]))
    streamed.sent(r, stream=True)
    assert streamed.measurements.link_cost(p.url, d.url).in_transit == 1
    streamed.prefill_done(r, p, 0.05, 100)
    assert streamed.measurements.link_cost(p.url, d.url).in_transit == 1
    streamed.first_token(r, time.perf_counter())
    assert streamed.measurements.link_cost(p.url, d.url).in_transit == 0
    # ... and, not streamed, until its predicted first token
    r = _route("y" * 400, 7)
    streamed.route(RequestPlan(r.request, [r]))
    streamed.sent(r, stream=False)
    flight = r.notes
    assert r.predicted_s is not None
    later = flight.sent + r.predicted_s
    assert streamed.measurements.link_cost(p.url, d.url, now=later - 1e-6).in_transit == 1
    assert streamed.measurements.link_cost(p.url, d.url, now=later + 1e-6).in_transit == 0


def test_the_decision_line_names_the_handoffs_in_transit(caplog: pytest.LogCaptureFixture) -> None:
    metrics, prefill, decode, config = _auto_pools()
    router = Router(replace(config, decode_tokens_per_s=200.0), prefill, decode, metrics, local=True)
    p, d = prefill.backends[0], decode.backends[0]
    r = _route("y" * 400, 0)
    router.route(RequestPlan(r.request, [r]))
    router.sent(r, stream=True)
    router.prefill_done(r, p, 0.05, 100)
    caplog.set_level("DEBUG", logger="disagg.proxy")
    probe = _route("y" * 400, 1)
    router.route(RequestPlan(probe.request, [probe]))
    assert f"; handoffs {p.url} -> {d.url} 1 in transit" in caplog.text


def test_decode_line_per_engine_flat_until_loads_differ_borrowed_until_measured_and_forgotten() -> None:
    m = Measurements(prefill_tokens_per_s=2000.0, decode_tokens_per_s=2000.0, overhead_s=0.0,
                     handoff_fixed_s=0.03, link_bytes_per_s=1e9)
    assert m.tpot_s("http://d:1", 1) is None and m.engine_cost("decode", "http://d:1", 0).tpot_s is None
    assert m.observe_decode("http://d:1", 1, 1.0) == "discarded"      # warm-up: the engine's first
    for _ in range(SEED_SAMPLES):
        assert m.observe_decode("http://d:1", 2, 0.040) == "used"
    # one load seen: flat at what was seen, whatever the load asked about
    assert m.tpot_s("http://d:1", 1) == pytest.approx(0.040) and m.tpot_s("http://d:1", 9) == pytest.approx(0.040)
    for _ in range(20):                                              # 30 ms + 5 ms per request in flight
        for n in (1, 4, 8):
            m.observe_decode("http://d:1", n, 0.030 + 0.005 * n)
    assert m.tpot_s("http://d:1", 6) == pytest.approx(0.060, rel=0.02)
    # the engine's cost asks the line at its requests in flight plus the one being routed
    assert m.engine_cost("decode", "http://d:1", 5).tpot_s == pytest.approx(0.060, rel=0.02)
    # an engine with no decodes of its own (a prefill engine) is priced with the others' line
    assert m.tpot_s("http://p:1", 1) == pytest.approx(0.035, rel=0.02)
    assert m.observe_decode("http://p:1", 1, 0.5) == "discarded"
    for _ in range(SEED_SAMPLES):
        m.observe_decode("http://p:1", 1, 0.020)
    assert m.tpot_s("http://p:1", 1) == pytest.approx(0.020)
    assert m.observe_decode("http://p:1", 1, float("nan")) == "invalid"
    m.forget("http://d:1")
    assert m.tpot_s("http://d:1", 6) == pytest.approx(0.020)         # its own line gone: P's now


def test_prefills_computed_beside_a_decode_leave_its_sample_and_price_the_engines_tpot_by_its_duty() -> None:
    """A reply's mean gap less the prefills its engine computed while it decoded is a sample of the
    decode step; the time per output token predicted there is that step over 1 - the engine's duty."""
    m = Measurements(prefill_tokens_per_s=1000.0, decode_tokens_per_s=1000.0, overhead_s=0.0,
                     handoff_fixed_s=0.03, link_bytes_per_s=1e9)
    d = "http://d:1"
    m.observe_decode(d, 1, 1.0)                                       # warm-up
    t = 100.0
    for _ in range(10):
        # a 500-token prompt (0.5 s on the line) prefilled on D while a 101-token reply decodes there
        # at 10 ms a step: its 100 gaps took 1.5 s, a 15 ms mean; its own prefill ended at its first token
        own = m.dispatch("decode", d, 100, now=t - 0.1)
        m.settle("decode", d, own, now=t)
        beside = m.dispatch("decode", d, 500, now=t + 0.2)
        m.settle("decode", d, beside, now=t + 0.7)
        assert m.observe_decode(d, 2, 0.015, t, t + 1.5) == "used"
        t += 20.0                                                      # past the duty window
    assert m.tpot_s(d, 2, t) == pytest.approx(0.010)                  # the step, nothing prefilled lately
    m.settle("decode", d, m.dispatch("decode", d, 2000, now=t - 3.0), now=t - 1.0)  # 2 s of the last 10
    assert m.engine_cost("decode", d, 1, now=t).prefill_duty == pytest.approx(0.2)
    assert m.tpot_s(d, 2, t) == pytest.approx(0.010 / 0.8)
    assert m.tpot_s(d, 2, t + DUTY_WINDOW_S) == pytest.approx(0.010)  # out of the window: the step again
    # a sample is kept at MIN_STEP_SHARE of itself, whatever is taken off it
    m2 = Measurements(prefill_tokens_per_s=1000.0, decode_tokens_per_s=1000.0, overhead_s=0.0,
                      handoff_fixed_s=0.03, link_bytes_per_s=1e9)
    m2.observe_decode(d, 1, 1.0)
    m2.settle("decode", d, m2.dispatch("decode", d, 10_000, now=t), now=t + 0.5)
    for _ in range(SEED_SAMPLES):
        m2.observe_decode(d, 1, 0.02, t, t + 1.0)
    assert m2.tpot_s(d, 1, t + 1.0) == pytest.approx(MIN_STEP_SHARE * 0.02 / (1 - MAX_DUTY))


def test_the_requests_decoding_on_an_engine_are_those_in_flight_less_its_unanswered_prefills() -> None:
    m = Measurements(prefill_tokens_per_s=1000.0, decode_tokens_per_s=1000.0, overhead_s=0.0,
                     handoff_fixed_s=0.03, link_bytes_per_s=1e9)
    d = "http://d:1"
    assert m.decoding(d, 3) == 3                                      # nothing sent there yet
    first = m.dispatch("decode", d, 100, now=0.0)
    m.dispatch("decode", d, 100, now=0.0)
    assert m.decoding(d, 5) == 3 and m.decoding(d, 1) == 0           # never below 0
    assert m.engine_cost("decode", d, 5, now=0.0).running == 3
    m.settle("decode", d, first, now=0.1)                             # its first token: decoding now
    assert m.decoding(d, 5) == 4
    m.dispatch("decode", d, 100, until=1.0, now=0.5)                  # not streamed: until its predicted end
    assert m.decoding(d, 5, now=0.9) == 3 and m.decoding(d, 5, now=1.0) == 4


def test_prefill_work_duty_window_and_what_ended_within_a_span() -> None:
    work = PrefillWork()
    work.add(1.0, 2.0)
    work.add(5.0, 1.0)
    work.add(6.0, float("nan"))                                       # not finite: not work
    work.add(7.0, -1.0)
    assert work.duty(6.0) == pytest.approx(0.3)
    assert work.between(1.0, 5.0) == pytest.approx(1.0)               # ended after the start, by the end
    assert work.between(0.0, 5.0) == pytest.approx(3.0)
    assert work.duty(1.0 + DUTY_WINDOW_S) == pytest.approx(0.1)       # the first has left the window
    assert work.duty(100.0) == 0.0
    work.add(101.0, 100.0)
    assert work.duty(101.0) == MAX_DUTY                               # capped: a saturated engine still decodes


def test_an_engines_cost_carries_its_decode_lines_slope_for_the_decode_work_it_adds() -> None:
    m = Measurements(prefill_tokens_per_s=2000.0, decode_tokens_per_s=2000.0, overhead_s=0.0,
                     handoff_fixed_s=0.03, link_bytes_per_s=1e9)
    assert m.engine_cost("decode", "http://d:1", 3).tpot_added_s == 0.0        # no line: nothing added
    m.observe_decode("http://d:1", 1, 1.0)                                       # warm-up
    for _ in range(20):                                                          # 30 ms + 5 ms per request
        for n in (1, 4, 8):
            m.observe_decode("http://d:1", n, 0.030 + 0.005 * n)
    cost = m.engine_cost("decode", "http://d:1", 3)
    assert cost.tpot_s == pytest.approx(0.050, rel=0.02) and cost.tpot_added_s == pytest.approx(0.005, rel=0.05)


def test_expected_output_tokens_is_the_replies_mean_capped_by_the_requests_max_tokens() -> None:
    m = Measurements(prefill_tokens_per_s=2000.0, decode_tokens_per_s=2000.0, overhead_s=0.0,
                     handoff_fixed_s=0.03, link_bytes_per_s=1e9)
    assert m.output_tokens() is None
    m.observe_output(100)
    m.observe_output(0)                                  # nothing decoded: no sample
    assert m.output_tokens() == 100
    for _ in range(30):
        m.observe_output(20)
    assert m.output_tokens() == pytest.approx(20, abs=0.1)
    # before any reply: no decode term, whatever the cap (4,096 says little of an answer's length)
    assert expected_output_tokens({"max_tokens": 64}, None) == 0.0
    assert expected_output_tokens({"max_tokens": 64}, 20.0) == 20.0
    assert expected_output_tokens({"max_tokens": 8}, 20.0) == 8.0
    assert expected_output_tokens({}, 20.0) == 16.0                     # completions: vLLM's default cap
    assert expected_output_tokens({}, 20.0, chat=True) == 20.0          # chat: no cap by default
    assert expected_output_tokens({"max_completion_tokens": 8, "max_tokens": 64}, 20.0, chat=True) == 8.0
    assert expected_output_tokens({"max_completion_tokens": 8, "max_tokens": 64}, 20.0) == 20.0  # chat's name
    for hostile in ("64", True, -1, float("nan"), None, [64]):
        assert expected_output_tokens({"max_tokens": hostile}, 20.0, chat=True) == 20.0
    # a JSON integer too large for a float, or infinity, is no crash and no cap
    assert expected_output_tokens({"max_tokens": int("1" + "0" * 400)}, 20.0) == 20.0
    assert expected_output_tokens({"max_tokens": float("inf")}, 20.0) == 20.0


def test_router_learns_decode_lines_from_streams_and_sends_whole_while_decode_is_the_bottleneck() -> None:
    """Streamed replies teach the decode engine's line (``fit="decode"``); once one more decode
    would run more than the factor slower there than on the idle prefill engine (which borrows
    that line at its own load), the next prompt goes ``whole`` with reason ``decode_load``."""
    metrics, prefill, decode, config = _auto_pools()
    # no whole while D learns (its 5 ms prefills give it a duty that makes it a shade slower than idle P)
    router = Router(replace(config, whole=False), prefill, decode, metrics, local=True)
    p, d = prefill.backends[0], decode.backends[0]
    for i in range(12):
        r = _route("y" * 40, i)
        d.outstanding = 0
        router.route(RequestPlan(r.request, [r]))
        assert r.path is RoutePath.LOCAL                  # 10 tokens: local
        load = 1 + 2 * (i % 4)                            # 1, 3, 5, 7 in flight
        d.outstanding = load
        router.sent(r, stream=True)
        router.first_token(r, time.perf_counter())
        router.decoded(r, d, 33, 0.0, 32 * (0.030 + 0.010 * load))
        router.finished(r)
    text = metrics.render().decode()
    assert sample_sum(text, "disagg_route_samples_total", fit="decode", outcome="discarded") == 1
    assert sample_sum(text, "disagg_route_samples_total", fit="decode", outcome="used") == 11
    assert router.measurements.tpot_s(d.url, 8) == pytest.approx(0.110, rel=0.02)
    assert router.measurements.output_tokens() == 33    # each reply's token events: the output expected
    d.outstanding = 7                                     # one more there: 110 ms; on idle P: 40 ms
    router.config = replace(router.config, whole=True)
    r = _route("y" * 40, 99)
    router.route(RequestPlan(r.request, [r]))
    assert (r.path, r.reason, r.prefill) == (RoutePath.WHOLE, "decode_load", p)
    assert sample_sum(metrics.render().decode(), "disagg_route_total", path="whole", reason="decode_load") == 1
    # a route never sent (no flight), or a reply with fewer than MIN_DECODE_EVENTS token events: no sample
    router.decoded(_route("z", 100), d, 33, 0.0, 1.0)
    router.sent(r, stream=True)
    router.first_token(r, time.perf_counter())
    router.decoded(r, p, MIN_DECODE_EVENTS - 1, 0.0, 0.5)
    assert sample_sum(metrics.render().decode(), "disagg_route_samples_total", fit="decode") == 12
    router.decoded(r, p, MIN_DECODE_EVENTS, 0.0, 0.5)
    assert sample_sum(metrics.render().decode(), "disagg_route_samples_total", fit="decode") == 13


def test_a_prefill_sent_to_a_busy_engine_teaches_the_busy_line_not_the_engines_own() -> None:
    """Only prefills sent while the engine had nothing in flight fit its line (the prefill's own
    time, which is also the stall it imposes); the others teach what load adds, against the
    requests in flight, which the time to first token includes and the stall does not."""
    m = Measurements(prefill_tokens_per_s=2000.0, decode_tokens_per_s=2000.0, overhead_s=0.0,
                     handoff_fixed_s=0.03, link_bytes_per_s=1e9)
    # no engine's line stands on samples yet: its error would pass for what load adds
    assert m.observe_prefill("decode", "d", 64.0, 0.5, in_flight=3) == "unfitted"
    assert m.observe_prefill("decode", "d", 64.0, 1.0) == "discarded"            # warm-up
    for i in range(12):                                                          # alone: 10 ms + 64 tokens at 3,200/s
        n = 64.0 + 64 * (i % 4)
        assert m.observe_prefill("decode", "d", n, 0.010 + n / 3200) == "used"
    line = m.engine_cost("decode", "d", 0)
    assert (line.overhead_s, line.tokens_per_s, line.busy_s) == (pytest.approx(0.010), pytest.approx(3200.0), 0.0)
    assert m.observe_prefill("decode", "d", 64.0, 1.0, in_flight=2) == "discarded"   # the busy line's warm-up
    for i in range(12):                         # with k in flight: 20 ms + 10 ms per request beyond the line
        k = (1, 4, 8)[i % 3]
        assert m.observe_prefill("decode", "d", 64.0, 0.010 + 64 / 3200 + 0.020 + 0.010 * k, in_flight=k) == "used"
    busy = m.engine_cost("decode", "d", 4)
    assert busy.tokens_per_s == pytest.approx(3200.0) and busy.busy_s == pytest.approx(0.060, abs=0.003)
    assert busy.ttft_s(64) == pytest.approx(0.010 + 64 / 3200 + 0.060, abs=0.003)
    assert busy.prefill_s(64) == pytest.approx(0.010 + 64 / 3200)     # the stall is the prefill's own time
    # the busy line's intercept (20 ms) is extrapolated below its samples: an idle engine is its line alone
    assert m.engine_cost("decode", "d", 1).busy_s == pytest.approx(0.030, abs=0.003)
    assert m.engine_cost("decode", "d", 0).busy_s == 0.0
    # faster than its line counts as 0 beyond it (the line of what load adds never goes below 0)
    assert m.observe_prefill("decode", "d", 64.0, 0.001, in_flight=1) == "used"
    m.forget("d")
    assert m.engine_cost("decode", "d", 4).busy_s == 0.0


def _teach_busy_line(m: Measurements) -> float:
    """Teach the decode engine "d" its line (10 ms + 3,200 tokens/s idle) and a busy line of 7 ms per
    request in flight; returns its busy time at 5 requests (35 ms)."""
    m.observe_prefill("decode", "d", 64.0, 1.0)                          # warm-up
    for i in range(8):
        m.observe_prefill("decode", "d", 64.0 * (1 + i % 4), 0.010 + 64 * (1 + i % 4) / 3200)
    m.observe_prefill("decode", "d", 64.0, 1.0, in_flight=2)             # the busy line's warm-up
    for i in range(12):                                                  # 7 ms per request in flight
        k = (1, 3, 5)[i % 3]
        m.observe_prefill("decode", "d", 64.0, 0.010 + 64 / 3200 + 0.007 * k, in_flight=k)
    busy = m.engine_cost("decode", "d", 5).busy_s
    assert busy == pytest.approx(0.035, abs=0.002)
    return busy


def test_a_streamed_split_into_a_busy_decode_engine_is_priced_with_that_engines_busy_line() -> None:
    """A split's first token waits for the decode engine's steps as a local prompt's does: the
    streamed fixed cost is its line plus the decode engine's busy line at that load, so a busy
    decode engine makes a split dearer while the line is still its idle seed, and a split's
    sample teaches the line only what it took beyond that busy line."""
    m = Measurements(prefill_tokens_per_s=2000.0, decode_tokens_per_s=2000.0, overhead_s=0.0,
                     handoff_fixed_s=0.04, link_bytes_per_s=1e9, streaming_layers=8)
    assert m.link_cost("p", "d", 5).fixed_s == pytest.approx(0.04)       # nothing measured of D yet
    busy = _teach_busy_line(m)
    assert m.link_cost("p", "d", 0).fixed_s == pytest.approx(0.04)      # idle: the seed alone
    assert m.link_cost("p", "d", 5).fixed_s == pytest.approx(0.04 + busy)
    # a 2-token prompt with 5 decodes running there: the split dearer than the local prefill
    decode = m.engine_cost("decode", "d", 5)
    link = m.link_cost("p", "d", 5)
    prefill = m.engine_cost("prefill", "p", 0)
    assert split_ttft(2, 2 * 1024, prefill, link, decode) > local_ttft(2, decode) + stall_s(2, decode)
    # splits that took 20 ms beyond the busy line at every load teach a flat 20 ms
    m.observe_streamed_split("p", "d", 1.0, 5)                           # the pair's warm-up
    for i in range(12):
        k = (0, 3, 5)[i % 3]
        m.observe_streamed_split("p", "d", 0.020 + m.engine_cost("decode", "d", k).busy_s, k)
    assert m.link_cost("p", "d", 0).fixed_s == pytest.approx(0.020, abs=0.002)
    assert m.link_cost("p", "d", 5).fixed_s == pytest.approx(0.020 + busy, abs=0.002)


def test_a_split_sent_after_its_prefill_into_a_busy_decode_engine_is_priced_with_that_engines_busy_line() -> None:
    """Not streamed, a handoff's first token waits for the decode engine's steps too: the pair's
    fixed cost is its line plus the decode engine's busy line at that load, and a handoff's sample
    teaches the pair's line only what it took beyond the busy line at the load it met."""
    m = Measurements(prefill_tokens_per_s=2000.0, decode_tokens_per_s=2000.0, overhead_s=0.0,
                     handoff_fixed_s=0.04, link_bytes_per_s=1e9)
    busy = _teach_busy_line(m)
    assert m.link_cost("p", "d", 0).fixed_s == pytest.approx(0.04)      # idle: the seed alone
    assert m.link_cost("p", "d", 5).fixed_s == pytest.approx(0.04 + busy)
    # handoffs of 10 ms + 200 MB/s beyond the busy line at every load teach that line, not the mean load
    assert m.observe_handoff("p", "d", 1e7, 2.0, 5) == "discarded"      # the pair's warm-up
    for i in range(12):
        k, nbytes = (0, 3, 5)[i % 3], 1e6 * (1 + i % 4)
        m.observe_handoff("p", "d", nbytes, 0.010 + nbytes / 2e8 + m.engine_cost("decode", "d", k).busy_s, k)
    idle, loaded = m.link_cost("p", "d", 0), m.link_cost("p", "d", 5)
    assert idle.fixed_s == pytest.approx(0.010, abs=0.002) and idle.bytes_per_s == pytest.approx(2e8, rel=0.05)
    assert loaded.fixed_s == pytest.approx(0.010 + busy, abs=0.002)


def test_a_line_seeded_flat_that_rises_steeply_goes_through_zero_not_flat() -> None:
    """A line with no intercept known (seeded flat, as the decode lines) whose samples rise more
    steeply than any line with an intercept >= 0 keeps rising (through 0 and the samples' mean)
    instead of falling back flat at their mean; samples all at x = 0 set the intercept for later."""
    fit = EwFit(math.inf, 1.0, (), warmup=0)
    for _ in range(6):
        for x, y in ((4.0, 0.02), (8.0, 0.10)):        # a least-squares intercept of -0.06
            fit.add(x, y)
    assert fit.predict(8.0) > fit.predict(4.0) > 0
    flat = EwFit(0.04, math.inf, (0.0, 8.0), warmup=0)
    for _ in range(6):
        flat.add(0.0, 0.2)
    assert flat.coefficients() == (pytest.approx(0.2), math.inf)
    for _ in range(3):
        flat.add(2.0, 0.1)          # falling: no physical line, flat at the mean (the 0.2 learned caps it)
    assert 0.1 < flat.coefficients()[0] < 0.2                # not the 0.04 seed


def test_the_router_prices_each_prompts_decode_work_at_its_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """:meth:`Router.route` passes :func:`expected_output_tokens` of each request to the policy."""
    import disagg.proxy.router as router_mod

    metrics, prefill, decode, config = _auto_pools()
    router = Router(config, prefill, decode, metrics, local=True)
    seen: list[float] = []
    real = router_mod.decide

    def spy(*args: object, **kw: object):  # type: ignore[no-untyped-def]
        seen.append(kw["out_tokens"])      # type: ignore[arg-type]
        return real(*args, **kw)           # type: ignore[arg-type]

    monkeypatch.setattr(router_mod, "decide", spy)
    router.measurements.observe_output(40)
    for i, cap in enumerate((8, 64)):
        body = {"prompt": "x" * 40, "stream": True, "max_tokens": cap}
        req = GenerationRequest(COMPLETIONS, body, b"{}", {}, f"c{i}")
        r = PromptRoute(0, req, RoutePath.SPLIT)
        router.route(RequestPlan(req, [r]))
    assert seen == [8.0, 40.0]


def test_the_router_books_each_routes_kv_and_prices_the_wait_for_room() -> None:
    """A route sent books its prompt and expected output on the engine that decodes it until its
    expected end (a split's prompt also on its prefill engine until the first token); a prompt
    that finds the decode engine's KV cache full is predicted to wait for that end; the route
    over, the room is free again."""
    metrics, prefill, decode, config = _auto_pools()
    p, d = prefill.backends[0], decode.backends[0]
    decode.set_kv_capacity(d, 150.0)
    router = Router(config, prefill, decode, metrics, local=True)
    for _ in range(SEED_SAMPLES + 1):           # a decode line of 0.1 s per output token (warm-up dropped)
        router.measurements.observe_decode(d.url, 1.0, 0.1)
    first = _route("x" * 400)                   # 100 tokens, no max_tokens: 16 output tokens booked
    router.route(RequestPlan(first.request, [first]))
    assert first.path is RoutePath.LOCAL and first.predicted_s == pytest.approx(0.05)
    sent = time.perf_counter()
    router.sent(first, stream=True, now=sent)
    assert router.kv.held_tokens(d.url) == 100 + 16
    second = _route("y" * 400, 1)
    before = time.perf_counter()
    router.route(RequestPlan(second.request, [second]))
    after = time.perf_counter()
    # 34 tokens free: it waits for the first one's end, 0.05 + 16 x 0.1 s after it was sent, on
    # either path (a split's KV needs room on the decode engine too: then its 30 ms handoff); the
    # router reads its clock somewhere between ``before`` and ``after``
    end = sent + 0.05 + 1.6 + 0.03
    assert second.path is RoutePath.SPLIT
    assert end - after - 1e-3 <= second.predicted_s <= end - before + 1e-3
    router.finished(first)
    assert router.kv.held_tokens(d.url) == 0
    third = _route("z" * 400, 2)
    router.route(RequestPlan(third.request, [third]))
    assert third.predicted_s == pytest.approx(0.05)
    # a split books its prompt on the prefill engine until its first token
    split = _route("s" * 400, 3)
    router.route(RequestPlan(split.request, [split]))
    split.path, split.prefill, split.decode = RoutePath.SPLIT, p, d
    router.sent(split, stream=True)
    assert (router.kv.held_tokens(p.url), router.kv.held_tokens(d.url)) == (100, 116)
    router.first_token(split, time.perf_counter())
    assert (router.kv.held_tokens(p.url), router.kv.held_tokens(d.url)) == (0, 116)
    router.finished(split)
    assert router.kv.held_tokens(d.url) == 0
