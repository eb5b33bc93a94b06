"""The routing policy as a pure function (disagg.proxy.policy.decide) with injected measurements:
the decision flips exactly where the predictor's break-even says, as prompt length, link rate,
prefill rate and queue cross it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from disagg.proxy.policy import Candidate, Explorer, decide
from disagg.routecost import EngineCost, LinkCost, Option, break_even_tokens

KV_PER_TOKEN = 32 * 1024.0


def kv(n: int) -> float:
    return n * KV_PER_TOKEN


def choose(n: int, p: EngineCost, d: EngineCost, link: LinkCost, **kw: object) -> Option:
    decision = decide("auto", n, kv(n), [Candidate("P", p)], [Candidate("D", d)], lambda _p, _d: link, **kw)
    return decision.path


FAST_P, SLOW_D = EngineCost(tokens_per_s=8000.0), EngineCost(tokens_per_s=1000.0)
LINK = LinkCost(fixed_s=0.03, bytes_per_s=1.25e9)


def test_prompt_length_crosses_the_break_even() -> None:
    n = break_even_tokens(kv, FAST_P, SLOW_D, LINK)
    assert n is not None
    assert choose(n - 1, FAST_P, SLOW_D, LINK) is Option.LOCAL
    assert choose(n, FAST_P, SLOW_D, LINK) is Option.SPLIT


def test_a_slower_link_moves_the_break_even_up_then_away() -> None:
    n = break_even_tokens(kv, FAST_P, SLOW_D, LINK)
    assert n is not None
    slower = LinkCost(LINK.fixed_s, LINK.bytes_per_s / 4)
    m = break_even_tokens(kv, FAST_P, SLOW_D, slower)
    assert m is not None and m > n
    assert choose(n, FAST_P, SLOW_D, slower) is Option.LOCAL
    assert choose(m, FAST_P, SLOW_D, slower) is Option.SPLIT
    # the link moves a token's KV slower than the decode engine computes it: never split
    crawl = LinkCost(LINK.fixed_s, KV_PER_TOKEN * SLOW_D.tokens_per_s / 2)
    assert break_even_tokens(kv, FAST_P, SLOW_D, crawl) is None
    assert choose(4 * m, FAST_P, SLOW_D, crawl) is Option.LOCAL


def test_prefill_rates_decide_at_idle() -> None:
    n = break_even_tokens(kv, FAST_P, SLOW_D, LINK)
    assert n is not None
    # the decode engine as fast as the prefill engine: a split never answers sooner at idle
    assert choose(n * 10, FAST_P, EngineCost(tokens_per_s=FAST_P.tokens_per_s), LINK) is Option.LOCAL
    # a faster decode engine than assumed pushes the break-even up
    quicker_d = EngineCost(tokens_per_s=SLOW_D.tokens_per_s * 1.5)
    m = break_even_tokens(kv, FAST_P, quicker_d, LINK)
    assert m is not None and m > n
    assert choose(n, FAST_P, quicker_d, LINK) is Option.LOCAL


def test_queues_shift_the_choice() -> None:
    same = EngineCost(tokens_per_s=2000.0)
    n = 200
    assert choose(n, same, same, LINK) is Option.LOCAL
    # prefill tokens waiting at the decode engine: long enough and the split wins
    wait = (LINK.seconds(kv(n))) * same.tokens_per_s
    backed_up = EngineCost(tokens_per_s=2000.0, queued_tokens=wait * 1.01)
    assert choose(n, same, backed_up, LINK) is Option.SPLIT
    assert choose(n, same, EngineCost(tokens_per_s=2000.0, queued_tokens=wait * 0.99), LINK) is Option.LOCAL
    # and a queue at the prefill engine sends it back
    assert choose(n, EngineCost(tokens_per_s=2000.0, queued_tokens=2 * wait), backed_up, LINK) is Option.LOCAL


def test_running_decodes_make_long_prompts_split() -> None:
    same = EngineCost(tokens_per_s=2000.0)
    busy = EngineCost(tokens_per_s=2000.0, running=1)
    short, long = 8, 4000
    per_token_stall = 1 / busy.tokens_per_s
    assert per_token_stall > KV_PER_TOKEN / LINK.bytes_per_s     # the link outruns prefill per token
    assert short * per_token_stall < LINK.seconds(kv(short))      # short: stalling costs less than a handoff
    assert choose(short, same, busy, LINK) is Option.LOCAL
    assert choose(long, same, busy, LINK) is Option.SPLIT
    assert choose(long, same, busy, LINK, stall_weight=0.0) is Option.LOCAL


def test_whole_only_on_an_idle_prefill_engine_while_every_decode_engine_is_backed_up() -> None:
    same = EngineCost(tokens_per_s=2000.0)
    backed_up = EngineCost(tokens_per_s=2000.0, queued_tokens=4000.0, waiting=2)
    d = decide("auto", 100, kv(100), [Candidate("P", same)], [Candidate("D", backed_up)], lambda _p, _d: LINK,
               whole=True)
    assert (d.path, d.reason, d.prefill, d.decode) == (Option.WHOLE, "decode_backlog", "P", None)
    assert d.predicted_s == pytest.approx(same.ttft_s(100))
    assert {o.path for o in d.options} == {Option.SPLIT, Option.LOCAL, Option.WHOLE}
    # the connector does not allow it, the prefill engine is busy, or one decode engine is free
    assert choose(100, same, backed_up, LINK, whole=False) is not Option.WHOLE
    busy_p = EngineCost(tokens_per_s=2000.0, running=1)
    assert choose(100, busy_p, backed_up, LINK, whole=True) is not Option.WHOLE
    # a prefill the estimate calls done but that has not answered yet: the engine is not idle
    prefilling_p = EngineCost(tokens_per_s=2000.0, queued_tokens=0.0, waiting=1)
    assert choose(100, prefilling_p, backed_up, LINK, whole=True) is not Option.WHOLE
    two = decide("auto", 100, kv(100), [Candidate("P", same)], [Candidate("D1", backed_up), Candidate("D2", same)],
                 lambda _p, _d: LINK, whole=True)
    assert two.path is Option.LOCAL and two.decode == "D2"


def test_handoffs_in_transit_on_the_link_turn_splits_local() -> None:
    """A prompt that splits over an idle link goes local once enough handoffs are in transit
    there (each is slowed by its transfer), and stays local with more: the flip is monotone."""
    p = EngineCost(tokens_per_s=4000.0, overhead_s=0.05)
    d = EngineCost(tokens_per_s=2000.0, overhead_s=0.03, running=3)
    link = LinkCost(fixed_s=0.03, bytes_per_s=1.25e8)
    n = 1000
    paths = [choose(n, p, d, replace(link, in_transit=k), stall_weight=1.0) for k in range(8)]
    assert paths[0] is Option.SPLIT and paths[-1] is Option.LOCAL
    flip = paths.index(Option.LOCAL)
    assert all(path is Option.LOCAL for path in paths[flip:])
    # the flip is where the split's score, raised by k transfers, passes the local one's
    transfer = kv(n) / 1.25e8
    local_score = d.ttft_s(n) + 3 * n / 2000
    split_score = p.ttft_s(n) + 0.03 + transfer
    assert split_score + (flip - 1) * transfer <= local_score < split_score + flip * transfer


def test_picks_the_cheapest_pair() -> None:
    slow_link, fast_link = LinkCost(0.03, 1e6), LinkCost(0.03, 1e10)
    links = {("P1", "D"): slow_link, ("P2", "D"): fast_link}
    busy_d = EngineCost(tokens_per_s=1000.0, running=8)
    d = decide("auto", 2000, kv(2000), [Candidate("P1", FAST_P), Candidate("P2", FAST_P)], [Candidate("D", busy_d)],
               lambda p, dd: links[(p, dd)])
    assert (d.path, d.prefill, d.decode) == (Option.SPLIT, "P2", "D")


def test_static_policies_and_what_cannot_be_served() -> None:
    cands = ([Candidate("P", FAST_P)], [Candidate("D", SLOW_D)])
    split = decide("split", 10**6, kv(10**6), *cands, lambda _p, _d: LINK)
    assert (split.path, split.reason, split.prefill, split.decode) == (Option.SPLIT, "policy", None, None)
    local = decide("local", 10**6, kv(10**6), *cands, lambda _p, _d: LINK)
    assert (local.path, local.reason, local.decode) == (Option.LOCAL, "policy", "D")
    # decode engines that cannot prefill (SGLang): split whatever the numbers say
    assert decide("auto", 1, kv(1), *cands, lambda _p, _d: LINK, local=False).path is Option.SPLIT
    # no healthy prefill engine: local; no healthy decode engine: whole where allowed, else split (503 later)
    assert decide("auto", 10**5, kv(10**5), [], cands[1], lambda _p, _d: LINK).reason == "no_prefill"
    assert decide("auto", 5, kv(5), cands[0], [], lambda _p, _d: LINK, whole=True).path is Option.WHOLE
    assert decide("auto", 5, kv(5), cands[0], [], lambda _p, _d: LINK).path is Option.SPLIT


# --- exploration -----------------------------------------------------------------------------

def always(_path: Option, _p: object, _d: object) -> bool:
    return True


def test_a_stale_path_within_the_factor_is_explored_once_named_explore() -> None:
    same = EngineCost(tokens_per_s=2000.0)
    n = 200                                         # local 0.1 s, split 0.1 + handoff 0.036 s: local wins
    best = decide("auto", n, kv(n), [Candidate("P", same)], [Candidate("D", same)], lambda _p, _d: LINK)
    assert (best.path, best.reason) == (Option.LOCAL, "predicted")
    asked: list[tuple[Option, object, object]] = []

    def stale(path: Option, p: object, d: object) -> bool:
        asked.append((path, p, d))
        return True

    d = decide("auto", n, kv(n), [Candidate("P", same)], [Candidate("D", same)], lambda _p, _d: LINK, stale=stale)
    assert (d.path, d.reason, d.prefill, d.decode) == (Option.SPLIT, "explore", "P", "D")
    assert d.predicted_s == pytest.approx(same.ttft_s(n) + LINK.seconds(kv(n)))
    assert asked == [(Option.SPLIT, "P", "D")]      # only the other path is asked about, with its engines
    # not stale: the best path
    assert decide("auto", n, kv(n), [Candidate("P", same)], [Candidate("D", same)], lambda _p, _d: LINK,
                  stale=lambda *_: False).reason == "predicted"
    # stale, but over twice the best's predicted TTFT: never explored
    slow = LinkCost(fixed_s=0.2, bytes_per_s=LINK.bytes_per_s)
    assert best.predicted_s is not None and slow.seconds(kv(n)) > best.predicted_s
    assert decide("auto", n, kv(n), [Candidate("P", same)], [Candidate("D", same)], lambda _p, _d: slow,
                  stale=always).reason == "predicted"
    # nor when the decode work both paths put on D would make it look within twice the best's score
    decoding = replace(same, tpot_s=0.050)
    assert decide("auto", n, kv(n), [Candidate("P", decoding)], [Candidate("D", decoding)], lambda _p, _d: slow,
                  stale=always, out_tokens=32).reason == "predicted"
    # exploring local asks with no prefill engine
    asked.clear()
    e = decide("auto", 4000, kv(4000), [Candidate("P", FAST_P)], [Candidate("D", SLOW_D)], lambda _p, _d: LINK,
               stale=stale, explore_within=10.0)
    assert (e.path, e.reason, e.prefill, e.decode) == (Option.LOCAL, "explore", None, "D")
    assert asked == [(Option.LOCAL, None, "D")]


def test_every_pair_is_explored_not_only_each_paths_best() -> None:
    """Two prefill engines: the split over the second (its link judged slower) gets no prompts by
    choice, so its estimate would never update; once stale it is explored like another path."""
    n = 4000
    quick, slower = LINK, LinkCost(fixed_s=LINK.fixed_s, bytes_per_s=LINK.bytes_per_s / 2)
    links = {("P1", "D"): quick, ("P2", "D"): slower}
    prefills = [Candidate("P1", FAST_P), Candidate("P2", FAST_P)]
    best = decide("auto", n, kv(n), prefills, [Candidate("D", SLOW_D)], lambda p, d: links[(p, d)])
    assert (best.path, best.reason, best.prefill) == (Option.SPLIT, "predicted", "P1")
    asked: list[tuple[Option, object, object]] = []

    def stale(path: Option, p: object, d: object) -> bool:
        asked.append((path, p, d))
        return p == "P2"

    e = decide("auto", n, kv(n), prefills, [Candidate("D", SLOW_D)], lambda p, d: links[(p, d)], stale=stale,
               explore_within=10.0)
    assert (e.path, e.reason, e.prefill, e.decode) == (Option.SPLIT, "explore", "P2", "D")
    assert e.predicted_s == pytest.approx(FAST_P.ttft_s(n) + slower.seconds(kv(n)))
    # cheapest first, each (path, engines) asked once (local over D is offered by both pairs), never the
    # chosen one: the slower split is cheaper than local here
    assert asked == [(Option.SPLIT, "P2", "D")]
    asked.clear()
    e = decide("auto", n, kv(n), prefills, [Candidate("D", SLOW_D)], lambda p, d: links[(p, d)],
               stale=lambda path, p, d: asked.append((path, p, d)) is not None, explore_within=10.0)
    assert e.reason == "predicted" and asked == [(Option.SPLIT, "P2", "D"), (Option.LOCAL, None, "D")]


def test_exploration_never_under_static_policies_nor_to_what_is_unavailable() -> None:
    cands = ([Candidate("P", FAST_P)], [Candidate("D", SLOW_D)])
    n = 10
    assert decide("split", n, kv(n), *cands, lambda _p, _d: LINK, stale=always).reason == "policy"
    assert decide("local", n, kv(n), *cands, lambda _p, _d: LINK, stale=always).reason == "policy"
    assert decide("auto", n, kv(n), *cands, lambda _p, _d: LINK, stale=always, local=False).reason == "policy"
    # no healthy prefill engine: no split to explore; no healthy decode engine: no local
    assert decide("auto", n, kv(n), [], cands[1], lambda _p, _d: LINK, stale=always).reason == "no_prefill"
    assert decide("auto", n, kv(n), cands[0], [], lambda _p, _d: LINK, stale=always, whole=True).path is Option.WHOLE
    # whole is never explored, even offered, stale and within the factor
    same = EngineCost(tokens_per_s=2000.0)
    quick_but_queued = EngineCost(tokens_per_s=20000.0, queued_tokens=100.0, waiting=1)
    d = decide("auto", 100, kv(100), [Candidate("P", same)], [Candidate("D", quick_but_queued)],
               lambda _p, _d: LINK, whole=True, stale=lambda path, _p, _d: path is Option.WHOLE,
               explore_within=100.0)
    assert (d.path, d.reason) == (Option.LOCAL, "predicted")
    assert Option.WHOLE in {o.path for o in d.options}


def test_explorer_needs_both_the_time_and_the_decisions_then_is_fresh_again() -> None:
    ex = Explorer(after_s=60.0, after_decisions=50)
    key = (Option.SPLIT, "P", "D")
    assert not ex.stale(*key, now=0.0)              # first seen: its clock starts now
    for i in range(49):
        ex.taken(Option.LOCAL, None, "D", now=i * 0.1)
    assert not ex.stale(*key, now=1000.0)           # 49 decisions: not yet, however long
    ex.taken(Option.LOCAL, None, "D", now=5.0)
    assert not ex.stale(*key, now=59.9)             # 50 decisions, 59.9 s: not yet
    assert ex.stale(*key, now=60.0)
    ex.taken(*key, now=60.0)                        # explored: fresh for another period
    for _ in range(100):
        ex.taken(Option.LOCAL, None, "D", now=61.0)
    assert not ex.stale(*key, now=119.0) and ex.stale(*key, now=120.0)
    assert not ex.stale(Option.LOCAL, None, "D", now=120.0)    # taken all along
    # the engine comes back: its keys start over
    ex.forget("P")
    assert not ex.stale(*key, now=10_000.0)
    for _ in range(50):
        ex.taken(Option.LOCAL, None, "D", now=10_000.0)
    assert ex.stale(*key, now=10_060.0)


def test_whole_when_decodes_run_slower_on_every_decode_engine_by_the_factor() -> None:
    """The ``decode_load`` rule: a prefill engine is offered ``whole`` when one more decode would
    take more than the factor x its time per output token on every decode engine; unmeasured
    lines or one decode engine within the factor keep it off. Prefills queued on the prefill
    engine do not: ``whole`` then competes on its score, which counts the queue."""
    p = EngineCost(tokens_per_s=2000.0, tpot_s=0.040)
    slow_d = EngineCost(tokens_per_s=2000.0, running=6, tpot_s=0.060)
    d = decide("auto", 100, kv(100), [Candidate("P", p)], [Candidate("D", slow_d)], lambda _p, _d: LINK,
               whole=True, whole_tpot_factor=1.25)
    assert (d.path, d.reason, d.prefill, d.decode) == (Option.WHOLE, "decode_load", "P", None)
    assert d.predicted_s == pytest.approx(p.ttft_s(100))
    near_d = replace(slow_d, tpot_s=0.049)                       # 1.225 x: within the factor
    assert choose(100, p, near_d, LINK, whole=True, whole_tpot_factor=1.25) is not Option.WHOLE
    assert choose(100, p, slow_d, LINK, whole=False) is not Option.WHOLE
    assert choose(100, replace(p, tpot_s=None), slow_d, LINK, whole=True) is not Option.WHOLE
    assert choose(100, p, replace(slow_d, tpot_s=None), LINK, whole=True) is not Option.WHOLE
    # a prefill queued on P (past saturation there always is one: the splits'): offered, the queue priced
    queued_p = replace(p, queued_tokens=200.0, waiting=1)
    d = decide("auto", 100, kv(100), [Candidate("P", queued_p)], [Candidate("D", slow_d)], lambda _p, _d: LINK,
               whole=True, whole_tpot_factor=1.25)
    assert (d.path, d.reason) == (Option.WHOLE, "decode_load")
    assert d.predicted_s == pytest.approx(queued_p.ttft_s(100)) and d.predicted_s > p.ttft_s(100)
    # ... and a queue that outweighs D's stall sends the prompt to D instead
    assert choose(100, replace(p, queued_tokens=4000.0, waiting=3), slow_d, LINK, whole=True) is Option.LOCAL
    # the backlog rule still wants an idle prefill engine
    backed_up = replace(slow_d, tpot_s=None, queued_tokens=4000.0, waiting=2)
    assert choose(100, replace(p, tpot_s=None, queued_tokens=200.0, waiting=1), backed_up, LINK,
                  whole=True) is not Option.WHOLE
    # decodes on P itself do not bar it (the rule compares the lines, which count them)
    assert choose(100, replace(p, running=3), slow_d, LINK, whole=True) is Option.WHOLE
    two = decide("auto", 100, kv(100), [Candidate("P", p)], [Candidate("D1", slow_d), Candidate("D2", near_d)],
                 lambda _p, _d: LINK, whole=True, whole_tpot_factor=1.25)
    assert two.path is not Option.WHOLE


def test_a_prefill_stalls_the_decodes_running_on_the_engine_that_computes_it() -> None:
    """Decodes running on the prefill engine (requests it serves ``whole``) are stalled by a split's
    prefill there as a local prefill stalls the decode engine's: the score says so."""
    same = EngineCost(tokens_per_s=2000.0)
    long = 4000
    busy_d = EngineCost(tokens_per_s=2000.0, running=1)
    assert choose(long, same, busy_d, LINK) is Option.SPLIT
    busier_p = EngineCost(tokens_per_s=2000.0, running=2)
    d = decide("auto", long, kv(long), [Candidate("P", busier_p)], [Candidate("D", busy_d)], lambda _p, _d: LINK)
    assert d.path is Option.LOCAL
    split = next(o for o in d.options if o.path is Option.SPLIT)
    assert split.score_s == pytest.approx(split.ttft_s + 2 * long / 2000.0)


def test_decode_work_sends_whole_a_prompt_its_first_token_alone_keeps_on_the_decode_engine() -> None:
    """Past saturation the decode engine's decodes limit goodput: a prompt whose first token would
    come sooner there (P is busier to first token) still goes ``whole`` once its 32 output tokens
    are priced at each side's time per output token (and what they add to the decodes running)."""
    p = EngineCost(tokens_per_s=2000.0, running=3, busy_s=0.5, tpot_s=0.040, tpot_added_s=0.003)
    d = EngineCost(tokens_per_s=2000.0, running=8, busy_s=0.05, tpot_s=0.080, tpot_added_s=0.005)
    first_token_only = decide("auto", 100, kv(100), [Candidate("P", p)], [Candidate("D", d)],
                              lambda _p, _d: LINK, whole=True)
    assert first_token_only.path is Option.LOCAL
    priced = decide("auto", 100, kv(100), [Candidate("P", p)], [Candidate("D", d)], lambda _p, _d: LINK,
                    whole=True, out_tokens=32)
    assert (priced.path, priced.reason) == (Option.WHOLE, "decode_load")
    by_path = {o.path: o for o in priced.options}
    assert by_path[Option.WHOLE].decode_s == pytest.approx(32 * (0.040 + 3 * 0.003 / 2))
    assert by_path[Option.LOCAL].decode_s == pytest.approx(32 * (0.080 + 8 * 0.005 / 2))
    # the predicted TTFT stays the first token's: the decode work is in the score alone
    assert priced.predicted_s == pytest.approx(p.ttft_s(100))
    # of two decode engines, the decode work picks the one that decodes faster, all else alike
    quick = replace(d, tpot_s=0.050)
    two = decide("auto", 100, kv(100), [], [Candidate("D1", d), Candidate("D2", quick)], lambda _p, _d: LINK,
                 out_tokens=32)
    assert two.decode == "D1"      # no prefill engine: the fallback picks by first token alone
    both = decide("auto", 100, kv(100), [Candidate("P", replace(p, tpot_s=None))],
                  [Candidate("D1", d), Candidate("D2", quick)], lambda _p, _d: LINK, out_tokens=32)
    assert both.decode == "D2"


def test_decode_work_is_priced_for_the_whole_decision_or_not_at_all() -> None:
    """A decode engine without a decode line would look free beside one that has it: then no option
    of the decision carries decode work, and the choice is the first token's."""
    fast = EngineCost(tokens_per_s=2000.0, tpot_s=0.030)
    unmeasured = EngineCost(tokens_per_s=1900.0)
    d = decide("auto", 100, kv(100), [Candidate("P", FAST_P)], [Candidate("D1", fast), Candidate("D2", unmeasured)],
               lambda _p, _d: LINK, out_tokens=32)
    assert all(o.decode_s == 0.0 for o in d.options) and d.decode == "D1"   # D1 prefills 100 tokens sooner


def test_exploration_never_sends_a_prompt_to_a_far_slower_decoder() -> None:
    """The bound on exploring leaves out the decode work for its first token, but an option whose
    decode work is beyond the factor x the chosen one's (another, slower decode engine) is never explored."""
    calm = EngineCost(tokens_per_s=2000.0, tpot_s=0.030)
    slow_decoder = EngineCost(tokens_per_s=2000.0, tpot_s=0.300)
    slow_link = LinkCost(fixed_s=0.2, bytes_per_s=LINK.bytes_per_s)       # no split within the factor

    def choose_with(out_tokens: float):  # type: ignore[no-untyped-def]
        return decide("auto", 100, kv(100), [Candidate("P", calm)],
                      [Candidate("D1", calm), Candidate("D2", slow_decoder)], lambda _p, _d: slow_link,
                      stale=lambda *_: True, out_tokens=out_tokens)

    unpriced = choose_with(0.0)
    assert (unpriced.path, unpriced.reason, unpriced.decode) == (Option.LOCAL, "explore", "D2")
    priced = choose_with(32.0)
    assert (priced.path, priced.reason, priced.decode) == (Option.LOCAL, "predicted", "D1")
