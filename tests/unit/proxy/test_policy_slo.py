"""``auto`` with an SLO (disagg.proxy.policy.decide, disagg.routecost.slo_value): each prompt takes
the path that maximises the requests expected to meet both objectives, and protects the running
decodes when its own objective is out of reach."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import pytest

from disagg.errors import ProxyError
from disagg.prometheus_text import sample_sum
from disagg.proxy.backends import BackendPool
from disagg.proxy.config import RoutingConfig
from disagg.proxy.metrics import ProxyMetrics
from disagg.proxy.policy import Candidate, Decision, decide
from disagg.proxy.router import Router
from disagg.proxy.routes import COMPLETIONS, GenerationRequest, PromptRoute, RequestPlan, RoutePath
from disagg.routecost import (
    DEFAULT_PREDICTION_ERROR,
    Decoding,
    EngineCost,
    LinkCost,
    Option,
    ServiceObjective,
    chance_within,
    meet_probability,
    newcomer_chance,
    option_costs,
    running_harm,
    running_slack,
    slo_value,
)

KV_PER_TOKEN = 32 * 1024.0
#: a prefill engine with nothing decoding, and a decode engine running ten decodes at 20 ms a token
IDLE_P = EngineCost(tokens_per_s=4000.0, tpot_s=0.015, tpot_added_s=0.001)
BUSY_D = EngineCost(tokens_per_s=4000.0, running=10, tpot_s=0.020, tpot_added_s=0.001)
#: a link that adds 400 ms to a split of 1,000 tokens
SLOW_LINK = LinkCost(fixed_s=0.4, bytes_per_s=1e12)


def route(n: int, p: EngineCost, d: EngineCost, link: LinkCost, **kw: object) -> Decision[str]:
    return decide("auto", n, n * KV_PER_TOKEN, [Candidate("P", p)], [Candidate("D", d)], lambda _p, _d: link,
                  out_tokens=64.0, **kw)


def test_running_slack_takes_each_followed_decode_as_decoding_slack_says() -> None:
    """running_slack writes Decoding.slack out for its cost: the two stay equal, for decodes
    ahead, behind, at their last gap, past their expected length (not followed) and lost."""
    objective = ServiceObjective(ttft_s=1.0, tpot_s=0.025)
    decodes = (Decoding(0.01 * 60, 60, 63), Decoding(0.02 * 31, 31, 63), Decoding(0.02 * 62, 62, 63),
               Decoding(0.02 * 80, 80, 63), Decoding(3.0, 10, 63), Decoding(0.5, 0, 1))
    engine = replace(BUSY_D, running=len(decodes), decodes=decodes)
    slack = running_slack(engine, 64.0, objective, 0.1)
    kept = [d for d in decodes if d.gaps < d.total_gaps and d.allowed_tpot_s(0.025) > 0]    # two lost
    assert len(kept) == 3 and slack.unseen == 1
    assert [left for _, left, _ in slack.followed] == [d.left_gaps() for d in kept]
    assert [log_allowed for log_allowed, _, _ in slack.followed] == pytest.approx(
        [math.log(d.allowed_tpot_s(0.025)) for d in kept])


def test_a_newcomers_tpot_chance_is_taken_once_per_engine_as_meet_probability_says() -> None:
    """running_slack judges one more request on the engine (what slo_value multiplies each option's
    TTFT chance by) as meet_probability does, with or without decodes running there."""
    tight = ServiceObjective(ttft_s=1.0, tpot_s=0.018)
    for engine in (IDLE_P, BUSY_D, replace(BUSY_D, tpot_s=math.inf), replace(IDLE_P, tpot_s=0.0)):
        assert running_slack(engine, 64.0, tight, 0.2).newcomer == pytest.approx(
            meet_probability(engine.tpot_s, 0.018, 0.2))
    assert running_slack(replace(IDLE_P, tpot_s=None), 64.0, tight, 0.2).newcomer == 1.0
    assert running_slack(BUSY_D, 64.0, ServiceObjective(ttft_s=1.0), 0.2).newcomer == 1.0
    # newcomer_chance (the decision's first pass, without the decodes) is the same number
    for engine in (IDLE_P, BUSY_D, replace(BUSY_D, tpot_s=math.inf), replace(IDLE_P, tpot_s=0.0),
                   replace(IDLE_P, tpot_s=None)):
        for slo in (tight, ServiceObjective(ttft_s=1.0), ServiceObjective(tpot_s=0.0)):
            assert newcomer_chance(engine, slo, 0.2) == running_slack(engine, 64.0, slo, 0.2).newcomer
    # an option's own chance: its TTFT's times the newcomer's where it decodes
    split = option_costs(1000, 1000 * KV_PER_TOKEN, IDLE_P, BUSY_D, SLOW_LINK)[0]
    value = slo_value(split, 1000, IDLE_P, BUSY_D, 64.0, tight, ttft_error=0.2, tpot_error=0.2)
    assert value.own == pytest.approx(meet_probability(split.ttft_s, 1.0, 0.2) * meet_probability(0.020, 0.018, 0.2))


def test_meeting_an_objective_is_a_distribution_around_the_prediction() -> None:
    assert meet_probability(0.1, 0.1, 0.3) == pytest.approx(0.5)
    # one typical error below the limit: one standard deviation of the log-normal
    assert meet_probability(0.1 / 1.3, 0.1, 0.3) == pytest.approx(0.8413, abs=1e-3)
    assert meet_probability(0.2, 0.1, 0.3) < 0.05
    assert meet_probability(0.05, None, 0.3) == 1.0
    assert meet_probability(math.inf, 10.0, 0.3) == 0.0
    # a larger measured error makes a prediction under the limit less sure
    assert meet_probability(0.08, 0.1, 0.6) < meet_probability(0.08, 0.1, 0.1)


def test_a_chance_within_a_limit_is_meet_probability_with_the_limit_taken_once() -> None:
    for limit in (None, 0.0, 0.1, 2.5):
        chance = chance_within(limit, 0.3)
        for predicted in (0.0, 0.05, 0.1, 1.0, math.inf):
            assert chance(predicted) == pytest.approx(meet_probability(predicted, limit, 0.3)), (limit, predicted)


def test_a_prefill_harms_the_running_decodes_only_past_their_tpot_slack() -> None:
    tight, loose = ServiceObjective(tpot_s=0.025), ServiceObjective(tpot_s=0.5)
    stall = BUSY_D.prefill_s(4000)                       # one second
    assert running_harm(BUSY_D, stall, 0, 64.0, loose, 0.1) == pytest.approx(0.0, abs=1e-6)
    harmed = running_harm(BUSY_D, stall, 0, 64.0, tight, 0.1)
    assert 9.0 < harmed <= 10.0                          # 19 ms + 1 s / 63 gaps = 35 ms > 25 ms: nearly all ten
    assert running_harm(IDLE_P, stall, 0, 64.0, tight, 0.1) == 0.0      # nothing decoding there
    assert running_harm(BUSY_D, stall, 0, 64.0, ServiceObjective(ttft_s=1.0), 0.1) == 0.0


def test_running_decodes_the_proxy_follows_are_judged_by_where_each_stands() -> None:
    """Three decodes at 20 ms a token against a 25 ms objective, 63 gaps each: one has missed it
    already (a 3 s stall behind it), one is nearly done with time to spare (it ran at 10 ms), one
    is halfway on the line. A 0.25 s prefill can only push the last one past the objective, and the count says so
    where the line alone (all three at 20 ms from their first token) says all three."""
    tight = ServiceObjective(tpot_s=0.025)
    lost = Decoding(elapsed_s=3.0 + 0.02 * 10, gaps=10, total_gaps=63)
    ahead = Decoding(elapsed_s=0.01 * 60, gaps=60, total_gaps=63)
    halfway = Decoding(elapsed_s=0.02 * 31, gaps=31, total_gaps=63)
    assert lost.allowed_tpot_s(0.025) < 0 < ahead.allowed_tpot_s(0.025)
    assert ahead.allowed_tpot_s(0.025) == pytest.approx((0.025 * 63 - 0.6) / 3)     # 325 ms a token left
    engine = replace(BUSY_D, running=3, tpot_added_s=0.0)
    stall = 0.25
    unseen = running_harm(engine, stall, 0, 64.0, tight, 0.1)
    assert unseen == pytest.approx(3 * (meet_probability(0.020, 0.025, 0.1)
                                        - meet_probability(0.020 + 0.25 / 63, 0.025, 0.1)))
    followed = replace(engine, decodes=(lost, ahead, halfway))
    only_halfway = meet_probability(0.020, halfway.allowed_tpot_s(0.025), 0.1) \
        - meet_probability(0.020 + 0.25 / 32, halfway.allowed_tpot_s(0.025), 0.1)
    assert running_harm(followed, stall, 0, 64.0, tight, 0.1) == pytest.approx(only_halfway, abs=1e-3)
    assert 0.1 < only_halfway < unseen / 3
    # the two it does not follow are taken as on the line, as before
    assert running_harm(replace(followed, running=5, decodes=(lost,)), stall, 0, 64.0, tight, 0.1) \
        == pytest.approx(4 * unseen / 3)
    # one past its expected length has at least a gap to go, and is judged as on the line (how far
    # it has still to go is not known)
    past = Decoding(elapsed_s=0.02 * 80, gaps=80, total_gaps=63)
    assert past.left_gaps() == 1.0
    assert running_harm(replace(followed, running=1, decodes=(past,)), stall, 0, 64.0, tight, 0.1) \
        == pytest.approx(unseen / 3)
    # an option that adds nothing there harms nobody
    assert running_harm(followed, 0.0, 0, 64.0, tight, 0.1) == 0.0


def test_each_engines_decodes_are_judged_once_per_decision_and_the_lost_ones_skipped() -> None:
    """The policy takes each engine's :func:`running_slack` once and asks it for every option: the
    same values as judging each option from the engine. A followed decode whose chance to meet the
    objective is as good as none (under 1e-4) is left out of the sums; what it would have counted
    is below that chance."""
    tight = ServiceObjective(ttft_s=1.0, tpot_s=0.025)
    halfway = Decoding(elapsed_s=0.02 * 31, gaps=31, total_gaps=63)
    nearly_lost = Decoding(elapsed_s=0.0317 * 40, gaps=40, total_gaps=63)    # 13.3 ms a token allowed, P at 14
    busy_p = replace(IDLE_P, running=2, decodes=(halfway, nearly_lost))
    busy_d = replace(BUSY_D, decodes=(halfway,))
    slacks = (running_slack(busy_p, 64.0, tight, 0.01), running_slack(busy_d, 64.0, tight, 0.01))
    assert len(slacks[0].followed) == 1 and slacks[0].unseen == 0      # the nearly lost one skipped
    assert meet_probability(0.014, nearly_lost.allowed_tpot_s(0.025), 0.01) < 1e-4
    for o in option_costs(1000, 1000 * KV_PER_TOKEN, busy_p, busy_d, SLOW_LINK, whole=True, out_tokens=64.0):
        once = slo_value(o, 1000, busy_p, busy_d, 64.0, tight, tpot_error=0.01, slacks=slacks)
        assert once == slo_value(o, 1000, busy_p, busy_d, 64.0, tight, tpot_error=0.01)
        # the decision's own pass: the TTFT chance times newcomer_chance where it decodes, the same number
        own = meet_probability(o.ttft_s, 1.0, DEFAULT_PREDICTION_ERROR) * newcomer_chance(
            busy_p if o.path is Option.WHOLE else busy_d, tight, 0.01)
        assert once == slo_value(o, 1000, busy_p, busy_d, 64.0, tight, tpot_error=0.01, slacks=slacks, own=own)
    # the running decodes step at the line with themselves (tpot_s prices one more): one request
    # joining them moves them from 19 to 20 ms a token, not from 20 to 21
    joined = running_harm(BUSY_D, 0.0, 1, 64.0, tight, 0.1)
    assert joined == pytest.approx(10 * (meet_probability(0.019, 0.025, 0.1) - meet_probability(0.020, 0.025, 0.1)))
    # no TPOT objective, no line or nothing running: nothing to harm
    for engine, slo in ((busy_p, ServiceObjective(ttft_s=1.0)), (replace(busy_p, tpot_s=None), tight),
                        (IDLE_P, tight)):
        assert running_slack(engine, 64.0, slo, 0.01).harm(10.0, 1) == 0.0


def test_a_decode_no_option_can_harm_is_left_out_of_the_sums() -> None:
    """A followed decode that even the largest stall the decision asks about (the prompt's prefill
    on the engine, with one more request joining) leaves at a chance within 1e-4 of certain is
    left out of the sums: what any option takes from it is below that. Asking a larger stall is an
    error (those decodes were not judged for it)."""
    slo = ServiceObjective(ttft_s=1.0, tpot_s=0.05)
    safe = Decoding(elapsed_s=0.001 * 10, gaps=10, total_gaps=63)        # 58 ms a token allowed, at 19
    borderline = Decoding(elapsed_s=2.46, gaps=40, total_gaps=63)        # 30 ms allowed
    engine = replace(BUSY_D, running=2, decodes=(safe, borderline))
    stall = engine.prefill_s(1000)
    judged = running_slack(engine, 64.0, slo, 0.1, most_stall_s=stall)
    every = running_slack(engine, 64.0, slo, 0.1)
    assert len(judged.followed) == 1 and len(every.followed) == 2 and judged.unseen == every.unseen == 0
    alone = replace(engine, running=1, decodes=(safe,))
    for asked, joins in ((stall, 1), (stall, 0), (0.0, 1), (stall / 3, 1)):
        assert running_harm(alone, asked, joins, 64.0, slo, 0.1) < 1e-4
        assert 0.0 <= every.harm(asked, joins) - judged.harm(asked, joins) < 1e-4
    assert judged.harm(stall, 1) > 0.01         # the borderline one is still judged
    with pytest.raises(ValueError, match="judged for"):
        judged.harm(stall * 1.01, 1)
    with pytest.raises(ValueError, match="one at most"):
        judged.harm(stall, 2)
    # the decision asks each engine about its own prefill of the prompt (no error), and decides as
    # without the safe one (the options' scores differ: they count every decode a prefill stalls)
    with_safe = route(1000, IDLE_P, engine, SLOW_LINK, slo=slo, tpot_error=0.1)
    without = route(1000, IDLE_P, replace(engine, running=1, decodes=(borderline,)), SLOW_LINK, slo=slo,
                    tpot_error=0.1)
    assert (with_safe.path, with_safe.reason, with_safe.predicted_s) == (without.path, without.reason,
                                                                         without.predicted_s)


def test_with_a_tight_tpot_objective_a_long_prompt_leaves_the_busy_decode_engine() -> None:
    """Without an SLO and with stalls weighted at nothing, the lowest predicted TTFT wins: the
    decode engine prefills 1,000 tokens in 250 ms where a split takes 650 ms. Under a TPOT
    objective of 25 ms that prefill makes its ten running decodes miss (20 ms + 250 ms / 63
    gaps = 24 ms, at the limit), the split harms none and still meets a 1 s TTFT objective."""
    plain = route(1000, IDLE_P, BUSY_D, SLOW_LINK, stall_weight=0.0)
    assert plain.path is Option.LOCAL and plain.reason == "predicted"
    slo = ServiceObjective(ttft_s=1.0, tpot_s=0.025)
    chosen = route(1000, IDLE_P, BUSY_D, SLOW_LINK, stall_weight=0.0, slo=slo, ttft_error=0.1, tpot_error=0.1)
    assert chosen.path is Option.SPLIT and chosen.reason == "slo"
    assert chosen.predicted_tpot_s == BUSY_D.tpot_s               # it decodes on the decode engine
    assert chosen.predicted_s == pytest.approx(0.25 + 0.4, rel=1e-3)


def test_with_a_tight_ttft_objective_the_prompt_is_served_where_it_meets_it() -> None:
    """The score weighs the stall on ten decodes (ten times the prefill) and splits; but those
    decodes have TPOT to spare (objective 200 ms), and only the local prefill meets a 500 ms
    TTFT objective: with the SLO the prompt stays local."""
    assert route(1000, IDLE_P, BUSY_D, SLOW_LINK).path is Option.SPLIT
    slo = ServiceObjective(ttft_s=0.5, tpot_s=0.2)
    chosen = route(1000, IDLE_P, BUSY_D, SLOW_LINK, slo=slo, ttft_error=0.1, tpot_error=0.1)
    assert chosen.path is Option.LOCAL and chosen.reason == "slo"


def test_when_no_path_meets_the_prompts_objective_the_score_decides() -> None:
    """A 10 ms TTFT objective no path meets: the prompt goes where auto without an SLO sends it,
    whatever the count of decodes each option would harm says (here, with the stall unweighted,
    the decode engine's local prefill, which the count would avoid for its ten decodes)."""
    slo = ServiceObjective(ttft_s=0.010, tpot_s=0.025)
    for weight in (0.0, 1.0):
        chosen = route(1000, IDLE_P, BUSY_D, SLOW_LINK, stall_weight=weight, slo=slo, ttft_error=0.1,
                       tpot_error=0.1)
        assert chosen.reason == "slo_missed"
        assert chosen.path is route(1000, IDLE_P, BUSY_D, SLOW_LINK, stall_weight=weight).path
    assert route(1000, IDLE_P, BUSY_D, SLOW_LINK, stall_weight=0.0, slo=slo).path is Option.LOCAL


class _Unread(Sequence[Decoding]):
    """Followed decodes that fail the test when read (the router's are taken when first read)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: object) -> Decoding:
        raise AssertionError("the followed decodes were read")


def test_when_no_path_meets_the_prompts_objective_the_running_decodes_are_not_judged() -> None:
    """The score decides there, so the decision does not take the followed decodes (the router
    builds them only when read); where an option meets it, it judges them."""
    slo = ServiceObjective(ttft_s=0.010, tpot_s=0.025)
    unread = replace(BUSY_D, decodes=_Unread(BUSY_D.running))
    chosen = route(1000, IDLE_P, unread, SLOW_LINK, whole=True, slo=slo, ttft_error=0.1, tpot_error=0.1)
    assert chosen.reason == "slo_missed"
    assert chosen == route(1000, IDLE_P, BUSY_D, SLOW_LINK, whole=True, slo=slo, ttft_error=0.1, tpot_error=0.1)
    with pytest.raises(AssertionError, match="were read"):
        route(1000, IDLE_P, unread, SLOW_LINK, whole=True, slo=ServiceObjective(ttft_s=0.5, tpot_s=0.025),
              ttft_error=0.1, tpot_error=0.1)


def test_a_saturated_engine_does_not_look_free_to_a_hopeless_prompt() -> None:
    """The decode engine's line is far past the TPOT objective (its queue of prompts), so by the
    count its decodes cannot be harmed any more, while a prefill on the prefill engine would push
    its four decodes past it; the prompt meets its TTFT objective nowhere. The count alone sends
    it to prefill behind the slow engine's queue (which only grows); the score splits it."""
    saturated = EngineCost(tokens_per_s=300.0, queued_tokens=9000.0, running=8, waiting=6, tpot_s=0.2,
                           tpot_added_s=0.01)
    decoding_p = replace(IDLE_P, running=4)
    slo = ServiceObjective(ttft_s=0.5, tpot_s=0.031)
    judged = {o.path: slo_value(o, 2048, decoding_p, saturated, 16, slo, ttft_error=0.1, tpot_error=0.1)
              for o in option_costs(2048, 0.0, decoding_p, saturated, SLOW_LINK, stall_weight=1.0)}
    assert judged[Option.LOCAL].good > judged[Option.SPLIT].good + 1      # what the count alone prefers
    chosen = route(2048, decoding_p, saturated, SLOW_LINK, slo=slo, ttft_error=0.1, tpot_error=0.1)
    assert chosen.reason == "slo_missed" and chosen.path is Option.SPLIT


def test_with_an_slo_whole_is_offered_where_the_count_prefers_it() -> None:
    """Engines alike: one more decode costs 20 ms a token on either, so neither ``whole`` rule
    holds and without an SLO the prompt is never served whole. With one, ``whole`` is an option
    like the others: the local prefill would stall the decode engine's ten decodes towards the
    25 ms objective, the split misses the 500 ms TTFT objective (its 400 ms handoff), and the
    prefill engine, decoding nothing, serves it whole and harms nobody."""
    p = EngineCost(tokens_per_s=4000.0, tpot_s=0.020, tpot_added_s=0.001)
    d = EngineCost(tokens_per_s=4000.0, running=10, tpot_s=0.020, tpot_added_s=0.001)
    assert route(1000, p, d, SLOW_LINK, whole=True).path is not Option.WHOLE
    slo = ServiceObjective(ttft_s=0.5, tpot_s=0.025)
    chosen = route(1000, p, d, SLOW_LINK, whole=True, slo=slo, ttft_error=0.1, tpot_error=0.1)
    assert chosen.path is Option.WHOLE and chosen.reason == "slo"
    assert chosen.prefill == "P" and chosen.predicted_tpot_s == p.tpot_s
    # where the connector does not allow it, the SLO does not offer it either
    assert route(1000, p, d, SLOW_LINK, slo=slo, ttft_error=0.1, tpot_error=0.1).path is not Option.WHOLE


def test_an_slo_without_decode_lines_judges_by_ttft_alone() -> None:
    """Engines not yet measured decoding (tpot_s None): no harm is priced and the TTFT objective
    decides; with every option meeting it equally, the score decides as without an SLO."""
    p, d = EngineCost(tokens_per_s=4000.0), EngineCost(tokens_per_s=4000.0, running=10)
    loose = ServiceObjective(ttft_s=30.0, tpot_s=0.025)
    assert route(1000, p, d, SLOW_LINK, slo=loose).path is route(1000, p, d, SLOW_LINK).path
    chosen = route(1000, p, d, SLOW_LINK, slo=ServiceObjective(ttft_s=0.5), ttft_error=0.1)
    assert chosen.path is Option.LOCAL and chosen.predicted_tpot_s is None


def test_the_router_routes_for_the_slo_and_learns_the_error_of_its_tpot_predictions() -> None:
    """Through the proxy's Router: with an SLO in its config a decision carries the SLO reason and
    the predicted TPOT (exported), and each streamed reply's TPOT moves the error the next
    decisions are judged with (exported too)."""
    metrics = ProxyMetrics()
    prefill, decode = BackendPool("prefill", ["http://p:1"], metrics), BackendPool("decode", ["http://d:1"], metrics)
    for pool in (prefill, decode):
        pool.mark_up(pool.backends[0])
    config = RoutingConfig(policy="auto", kv_bytes_per_token=1024.0, prefill_tokens_per_s=2000.0,
                           link_bytes_per_s=1e9, handoff_fixed_s=0.03, slo_ttft_s=1.0, slo_tpot_s=0.05)
    router = Router(config, prefill, decode, metrics, local=True)
    d = decode.backends[0]
    for load in (1, 2, 3, 4):                  # the decode engine's line: 10 ms + 5 ms per request in flight
        for _ in range(4):
            router.measurements.observe_decode(d.url, load, 0.010 + 0.005 * load)
    assert router.tpot_error.value == DEFAULT_PREDICTION_ERROR
    body = {"prompt": "x" * 400, "stream": True}
    req = GenerationRequest(COMPLETIONS, body, json.dumps(body).encode(), {}, "r")
    route = PromptRoute(0, req, RoutePath.SPLIT)
    router.route(RequestPlan(req, [route]), started=0.0)
    assert route.reason == "slo"
    assert route.predicted_tpot_s == pytest.approx(0.015, rel=0.2)     # one request in flight
    text = metrics.render().decode()
    assert sample_sum(text, "disagg_route_total", path=route.path.value, reason="slo") == 1
    assert sample_sum(text, "disagg_route_predicted_tpot_seconds_count", path=route.path.value) == 1
    route.sent(stream=True, now=time.perf_counter())
    route.first_token(time.perf_counter())
    # the reply ran at twice the predicted time per token: a 50% error
    predicted = route.predicted_tpot_s
    route.decoded(d, 20, 1.0, 1.0 + 19 * 2 * predicted)
    route.finished()
    text = metrics.render().decode()
    assert sample_sum(text, "disagg_route_tpot_error_ratio_count", path=route.path.value) == 1
    assert sample_sum(text, "disagg_route_tpot_error_ratio_sum", path=route.path.value) == pytest.approx(0.5)
    assert router.tpot_error.value == pytest.approx(DEFAULT_PREDICTION_ERROR + 0.05 * (0.5 - DEFAULT_PREDICTION_ERROR))
    route.decoded(d, 20, 1.0, 2.0)             # after finished(): nobody is told any more
    assert sample_sum(metrics.render().decode(), "disagg_route_tpot_error_ratio_count", path=route.path.value) == 1


def test_the_router_follows_the_streams_decoding_on_each_engine_while_they_run() -> None:
    """With a TPOT objective, a watched stream counts on the engine that decodes it from its first
    token until the route is over, with its progress (the token events the relay counted); a stream not
    watched (several choices, not streamed) or a route without an SLO is not followed."""
    metrics = ProxyMetrics()
    prefill, decode = BackendPool("prefill", ["http://p:1"], metrics), BackendPool("decode", ["http://d:1"], metrics)
    for pool in (prefill, decode):
        pool.mark_up(pool.backends[0])

    @dataclass
    class Counted:
        token_events: int = 0

    def started(router: Router, watched: Counted | None) -> PromptRoute:
        body = {"prompt": "x" * 400, "stream": True, "max_tokens": 64}
        req = GenerationRequest(COMPLETIONS, body, json.dumps(body).encode(), {}, "r")
        route = PromptRoute(0, req, RoutePath.SPLIT)
        router.route(RequestPlan(req, [route]), started=0.0)
        route.sent(stream=True, now=time.perf_counter())
        if watched is not None:
            route.watch(watched)
        route.first_token(time.perf_counter())
        return route

    for slo in ({"slo_ttft_s": 1.0}, {"slo_ttft_s": 1.0, "slo_tpot_s": 0.05}):
        config = RoutingConfig(policy="auto", kv_bytes_per_token=1024.0, prefill_tokens_per_s=2000.0,
                               link_bytes_per_s=1e9, handoff_fixed_s=0.03, **slo)
        router = Router(config, prefill, decode, metrics, local=True)
        progress = Counted()
        route, unwatched = started(router, progress), started(router, None)
        engine = route.prefill if route.path is RoutePath.WHOLE else route.decode
        assert engine is not None, (route.path, route.reason)
        engine.outstanding += 1                         # the app's lease, as the route is served
        progress.token_events = 11
        pool = decode if engine.role == "decode" else prefill
        costs = router._candidates(pool)[0].cost
        if "slo_tpot_s" not in slo:
            assert costs.decodes == ()
            continue
        ((elapsed, gaps, total_gaps),) = costs.decodes      # as Decoding names them
        assert gaps == 10 and total_gaps == 63 and elapsed >= 0
        route.finished()
        unwatched.finished()
        engine.outstanding -= 1
        assert router._candidates(pool)[0].cost.decodes == ()


def test_an_slo_is_a_routing_setting_of_its_own() -> None:
    assert RoutingConfig().slo is None
    assert RoutingConfig(slo_tpot_s=0.02).slo == ServiceObjective(None, 0.02)
    with pytest.raises(ProxyError, match="slo_ttft_s"):
        RoutingConfig(slo_ttft_s=0.0)
