"""The routing arithmetic (disagg.routecost): predicted TTFT per path and the idle break-even."""

from __future__ import annotations

from dataclasses import replace
from itertools import pairwise

import pytest

from disagg.routecost import (
    DEFAULT_HANDOFF_FIXED_S,
    HANDOFF_FIXED_S,
    EngineCost,
    LinkCost,
    Option,
    break_even_tokens,
    cheapest,
    decode_s,
    exposed_transfer_s,
    first_step_s,
    handoff_fixed_s,
    held_up_s,
    kv_wait_s,
    link_held_up_s,
    local_ttft,
    max_transfer_s,
    option_costs,
    split_gain_s,
    split_ttft,
    whole_ttft,
)

KV_PER_TOKEN = 32 * 1024


def kv(n: int) -> float:
    return n * KV_PER_TOKEN


def test_ttft_is_queue_wait_plus_prefill_plus_handoff() -> None:
    p = EngineCost(tokens_per_s=4000.0, overhead_s=0.002, queued_tokens=1000.0)
    d = EngineCost(tokens_per_s=1000.0, overhead_s=0.001, queued_tokens=500.0)
    link = LinkCost(fixed_s=0.02, bytes_per_s=1e8)
    n = 300
    assert local_ttft(n, d) == pytest.approx(500 / 1000 + 0.001 + n / 1000)
    assert whole_ttft(n, p) == pytest.approx(1000 / 4000 + 0.002 + n / 4000)
    assert split_ttft(n, kv(n), p, link) == pytest.approx(whole_ttft(n, p) + 0.02 + kv(n) / 1e8)
    # the handoff overlaps the decode engine's queue, but the first token waits for its end
    arrived = whole_ttft(n, p) + 0.02 + kv(n) / 1e8
    assert arrived < 0.45 < d.wait_s()
    assert split_ttft(n, kv(n), p, link, d) == pytest.approx(d.wait_s())
    shorter = EngineCost(tokens_per_s=1000.0, queued_tokens=100.0)
    assert split_ttft(n, kv(n), p, link, shorter) == pytest.approx(arrived)


def test_busy_time_and_queue_wait_price_the_same_delay_so_the_longer_counts() -> None:
    """The busy line is learned where next to nothing was queued: it is the work ahead that the
    queue estimate missed, so where a queue is estimated the two are not added."""
    queued = EngineCost(tokens_per_s=1000.0, overhead_s=0.01, queued_tokens=500.0, busy_s=0.2)
    assert queued.ttft_s(100) == pytest.approx(0.5 + 0.01 + 0.1)
    assert replace(queued, busy_s=0.8).ttft_s(100) == pytest.approx(0.8 + 0.01 + 0.1)
    assert replace(queued, queued_tokens=0.0).ttft_s(100) == pytest.approx(0.2 + 0.01 + 0.1)
    # the stall a prefill imposes is its own time, whatever waits ahead of it
    assert queued.prefill_s(100) == pytest.approx(0.01 + 0.1)


def test_break_even_is_where_the_split_starts_answering_sooner() -> None:
    p, d = EngineCost(tokens_per_s=8000.0), EngineCost(tokens_per_s=1000.0)
    link = LinkCost(fixed_s=0.03, bytes_per_s=1e9)
    n = break_even_tokens(kv, p, d, link)
    assert n is not None and n > 1
    assert split_gain_s(n, kv, p, d, link) >= 0 > split_gain_s(n - 1, kv, p, d, link)
    # the closed form for linear KV: n * (1/d - 1/p - kv/bw) = fixed
    per_token = 1 / 1000 - 1 / 8000 - KV_PER_TOKEN / 1e9
    assert n == pytest.approx(0.03 / per_token, abs=1)


def test_no_break_even_when_engines_are_alike_or_the_link_too_slow() -> None:
    same = EngineCost(tokens_per_s=2000.0)
    assert break_even_tokens(kv, same, same, LinkCost(0.001, 1e12)) is None
    fast_p, slow_d = EngineCost(tokens_per_s=8000.0), EngineCost(tokens_per_s=1000.0)
    # a link that moves a token's KV slower than the decode engine computes it
    assert break_even_tokens(kv, fast_p, slow_d, LinkCost(0.0, KV_PER_TOKEN * 900.0)) is None


def test_stall_of_running_decodes_counts_against_local() -> None:
    p = EngineCost(tokens_per_s=2000.0)
    link = LinkCost(fixed_s=0.03, bytes_per_s=1e9)
    idle_d, busy_d = EngineCost(tokens_per_s=2000.0), EngineCost(tokens_per_s=2000.0, running=4)
    n = 1000
    assert cheapest(option_costs(n, kv(n), p, idle_d, link, stall_weight=1.0)).path is Option.LOCAL
    busy = option_costs(n, kv(n), p, busy_d, link, stall_weight=1.0)
    local = next(o for o in busy if o.path is Option.LOCAL)
    assert local.score_s == pytest.approx(local.ttft_s + 4 * n / 2000)
    assert cheapest(busy).path is Option.SPLIT
    assert cheapest(option_costs(n, kv(n), p, busy_d, link, stall_weight=0.0)).path is Option.LOCAL


def test_a_prefill_holds_up_as_many_later_prompts_as_are_waiting_there() -> None:
    """Little's law: as many prompts arrive during one's wait as were waiting ahead of it, and each
    is held up by its prefill. A prefill engine with a growing queue of splits (the decision
    logged at 4 req/s: P 1,019 tokens/s with 1,736 tokens queued over 7 prompts, D 1,207
    tokens/s decoding 10) stops taking more once that cost counts; an idle engine costs nothing."""
    assert held_up_s(500, EngineCost(tokens_per_s=1000.0)) == 0.0
    assert held_up_s(500, EngineCost(tokens_per_s=1000.0, waiting=3)) == pytest.approx(1.5)
    link = LinkCost(fixed_s=0.05, bytes_per_s=1.25e8)
    d = EngineCost(tokens_per_s=1207.0, overhead_s=0.004, running=10)
    n = 537
    queued_p = EngineCost(tokens_per_s=1019.0, overhead_s=0.055, queued_tokens=1736.0, waiting=7)
    split, local = option_costs(n, kv(n), queued_p, d, link, stall_weight=1.0)
    assert split.ttft_s > 2.0 > 0.5 > local.ttft_s
    assert split.score_s == pytest.approx(split.ttft_s + 7 * n / 1019)
    assert local.score_s == pytest.approx(local.ttft_s + 10 * n / 1207)
    assert cheapest([split, local]).path is Option.LOCAL
    # the same queued tokens with no prompt counted waiting (so none held up) still split: the
    # stall on 10 decodes outweighs the queue's wait, which is how the queue kept growing
    none_waiting = replace(queued_p, waiting=0)
    assert cheapest(option_costs(n, kv(n), none_waiting, d, link, stall_weight=1.0)).path is Option.SPLIT
    # whole pays the same on the prefill engine
    whole = option_costs(n, kv(n), queued_p, d, link, whole=True)[2]
    assert whole.score_s == pytest.approx(whole.ttft_s + 7 * n / 1019)


def test_a_split_holds_up_the_handoffs_in_transit_on_its_link() -> None:
    """Nothing on an idle link; ``in_transit`` x its transfer on a busy one, in the split's score
    only (not in its TTFT: the link's fitted line holds the queueing it measured). Shaped on the
    NIXL decisions logged at 8 req/s over an emulated 1 Gb/s link (P 1,858 tokens/s, D 2,621
    tokens/s decoding about 20, a 516-token prompt of the KV-heavy model, handoffs ~0.6 s):
    the split is the cheaper option on an idle link, and 5 handoffs in transit make it the
    dearer one."""
    n, nbytes = 516, 516 * 80e3
    idle = LinkCost(fixed_s=0.05, bytes_per_s=7e7)
    busy = replace(idle, in_transit=5)
    assert link_held_up_s(nbytes, idle) == 0.0
    assert link_held_up_s(nbytes, busy) == pytest.approx(5 * nbytes / 7e7)
    p = EngineCost(tokens_per_s=1858.0, overhead_s=0.055, busy_s=0.25, running=1)
    d = EngineCost(tokens_per_s=2621.0, overhead_s=0.029, busy_s=0.22, running=20)
    split_idle, local_idle = option_costs(n, nbytes, p, d, idle, stall_weight=1.0)
    split_busy, local_busy = option_costs(n, nbytes, p, d, busy, stall_weight=1.0)
    assert split_busy.ttft_s == split_idle.ttft_s and local_busy == local_idle
    assert split_busy.score_s - split_idle.score_s == pytest.approx(link_held_up_s(nbytes, busy))
    assert cheapest([split_idle, local_idle]).path is Option.SPLIT
    assert cheapest([split_busy, local_busy]).path is Option.LOCAL
    # whole moves no KV: the link's load leaves it as it was
    assert option_costs(n, nbytes, p, d, busy, whole=True)[2] == option_costs(n, nbytes, p, d, idle, whole=True)[2]


def test_ties_go_local_then_split_then_whole() -> None:
    e = EngineCost(tokens_per_s=1000.0)
    opts = option_costs(100, 0.0, e, e, LinkCost(0.0, 1e12), whole=True)
    assert {o.score_s for o in opts} == {opts[0].score_s}
    assert cheapest(opts).path is Option.LOCAL


def test_fixed_cost_per_connector_is_the_measured_one() -> None:
    for connector, fixed in HANDOFF_FIXED_S.items():
        assert handoff_fixed_s(connector) == fixed > 0
    # an unmeasured connector gets the larger of the pulled handoffs' (push writes after the prefill
    # under a protocol of its own: its cost says nothing of another connector's)
    assert handoff_fixed_s("mooncake") == DEFAULT_HANDOFF_FIXED_S == max(HANDOFF_FIXED_S["nixl"],
                                                                        HANDOFF_FIXED_S["socket"])
    assert handoff_fixed_s("nixl-push") > DEFAULT_HANDOFF_FIXED_S


def test_first_step_reads_the_weights_and_the_prompts_kv() -> None:
    """Decode's first step after a sequential handoff: weights + KV bytes at the memory rate."""
    assert first_step_s(78e6, 0.0, 3e9) == pytest.approx(0.026)
    assert first_step_s(78e6, 134e6, 3e9) == pytest.approx(0.0707, rel=1e-3)
    assert first_step_s(0.0, 0.0, 3e9) == 0.0


# --- a streamed handoff: the KV leaves layer by layer while the prefill computes ------------

def test_streamed_exposure_is_sequential_without_layers_or_with_one() -> None:
    for x, p in ((0.3, 0.1), (0.1, 0.3), (0.0, 0.2), (0.2, 0.0)):
        assert exposed_transfer_s(x, p, None) == x == exposed_transfer_s(x, p, 1)


def test_streamed_exposure_between_one_layers_send_and_the_whole_transfer() -> None:
    layers = 32
    # the link far slower than the prefill: the last byte lands about X + P / L after the prefill starts
    x, p = 10.0, 0.1
    assert p + exposed_transfer_s(x, p, layers) == pytest.approx(x + p / layers)
    assert exposed_transfer_s(x, p, layers) == pytest.approx(x - p + p / layers)
    # the prefill far slower than the link: only the last layer's send is left, P + X / L in all
    x, p = 0.1, 10.0
    assert exposed_transfer_s(x, p, layers) == pytest.approx(x / layers)
    assert p + exposed_transfer_s(x, p, layers) == pytest.approx(p + x / layers)
    # alike: the two ends meet
    assert exposed_transfer_s(1.0, 1.0, layers) == pytest.approx(1.0 / layers)
    for x, p in ((0.3, 0.1), (0.1, 0.3), (5.0, 0.01), (0.01, 5.0)):
        assert x / layers <= exposed_transfer_s(x, p, layers) <= x


def _simulated_end(x: float, p: float, layers: int) -> float:
    """The streamed transfer's end, step by step: layer l computed at l P / L, sent (X / L) once
    computed and once the link is free."""
    end = 0.0
    for layer in range(1, layers + 1):
        end = max(layer * p / layers, end) + x / layers
    return end


@pytest.mark.parametrize("layers", [2, 7, 32, 61])
def test_streamed_exposure_is_the_layer_by_layer_schedule_in_closed_form(layers: int) -> None:
    for x, p in ((0.3, 0.1), (0.1, 0.3), (1.0, 1.0), (2.0, 1.9), (0.0, 1.0), (1.0, 0.0)):
        assert p + exposed_transfer_s(x, p, layers) == pytest.approx(_simulated_end(x, p, layers))


def test_streamed_end_grows_with_transfer_and_prefill_and_exposure_never_grows_with_prefill() -> None:
    grid = [0.0, 0.01, 0.05, 0.1, 0.3, 1.0, 3.0]
    for layers in (None, 1, 4, 32):
        for a, b in pairwise(grid):
            for other in grid:
                assert exposed_transfer_s(a, other, layers) <= exposed_transfer_s(b, other, layers)
                assert other + exposed_transfer_s(a, other, layers) <= other + exposed_transfer_s(b, other, layers)
                assert a + exposed_transfer_s(other, a, layers) <= b + exposed_transfer_s(other, b, layers)
                assert exposed_transfer_s(other, b, layers) <= exposed_transfer_s(other, a, layers)


@pytest.mark.parametrize("layers", [None, 1, 4, 32])
def test_max_transfer_is_the_exposures_inverse(layers: int | None) -> None:
    for budget, p in ((0.05, 0.2), (0.2, 0.05), (0.1, 0.1), (1.0, 0.0)):
        x = max_transfer_s(budget, p, layers)
        assert exposed_transfer_s(x, p, layers) == pytest.approx(budget)
        assert exposed_transfer_s(x * 1.01, p, layers) > budget
    assert max_transfer_s(0.0, 1.0, 32) == 0.0 == max_transfer_s(-0.1, 1.0, None)


def test_streamed_split_hides_the_transfer_behind_the_prefill_s_tokens_over_rate() -> None:
    p = EngineCost(tokens_per_s=4000.0, overhead_s=0.002, queued_tokens=1000.0)
    seq = LinkCost(fixed_s=0.02, bytes_per_s=1e8)
    streamed = LinkCost(fixed_s=0.02, bytes_per_s=1e8, streaming_layers=32)
    assert LinkCost(0.02, 1e8, None) == seq
    for n in (100, 1000, 20_000):
        x, pre = kv(n) / 1e8, n / 4000.0
        assert split_ttft(n, kv(n), p, seq) == pytest.approx(whole_ttft(n, p) + 0.02 + x)
        # queue wait and overhead are not hidden: only the prefill's own n / rate overlaps the transfer
        assert split_ttft(n, kv(n), p, streamed) == pytest.approx(
            p.wait_s() + 0.002 + max(pre + x / 32, x + pre / 32) + 0.02)
        assert split_ttft(n, kv(n), p, streamed) < split_ttft(n, kv(n), p, seq)
        assert split_ttft(n, kv(n), p, replace(streamed, streaming_layers=1)) == split_ttft(n, kv(n), p, seq)
    # the decode engine's queue still bounds it from below
    busy_d = EngineCost(tokens_per_s=1000.0, queued_tokens=5000.0)
    assert split_ttft(100, kv(100), p, streamed, busy_d) == pytest.approx(5.0)


def test_streaming_moves_the_idle_break_even_down() -> None:
    p, d = EngineCost(tokens_per_s=8000.0), EngineCost(tokens_per_s=1000.0)
    link = LinkCost(fixed_s=0.03, bytes_per_s=1e9)
    seq = break_even_tokens(kv, p, d, link)
    streamed = break_even_tokens(kv, p, d, replace(link, streaming_layers=32))
    assert seq is not None and streamed is not None and streamed < seq
    assert split_gain_s(streamed, kv, p, d, replace(link, streaming_layers=32)) >= 0
    assert split_gain_s(streamed - 1, kv, p, d, replace(link, streaming_layers=32)) < 0
    # a link that moves a token's KV a little faster than D computes it: after P's prefill the
    # sequential handoff never catches up with the local prefill, streamed alongside it does
    close = LinkCost(0.0, KV_PER_TOKEN * 1100.0)
    assert break_even_tokens(kv, p, d, close) is None
    assert break_even_tokens(kv, p, d, replace(close, streaming_layers=32)) == 1
    # a link slower than D computes: streaming cannot help (the last byte lands after X alone)
    crawl = LinkCost(0.0, KV_PER_TOKEN * 900.0)
    assert break_even_tokens(kv, p, d, replace(crawl, streaming_layers=32)) is None


def test_a_streamed_handoff_has_its_own_measured_fixed_cost() -> None:
    from disagg.routecost import STREAMED_HANDOFF_FIXED_S, handoff_fixed_source

    assert handoff_fixed_s("socket", streaming=True) == STREAMED_HANDOFF_FIXED_S["socket"] == 0.040
    assert handoff_fixed_s("socket") == HANDOFF_FIXED_S["socket"]
    assert handoff_fixed_s("nixl", streaming=True) == HANDOFF_FIXED_S["nixl"]   # nothing streamed measured
    assert "of a streamed split" in handoff_fixed_source(True) and "streamed" not in handoff_fixed_source(False)


def test_decode_work_is_priced_on_the_engine_that_decodes() -> None:
    """:func:`decode_s`: the request's own tokens at the engine's time per output token, plus what
    it adds to each running decode for about half of them (weighted like a stall); split and local
    put it on the decode engine, whole on the prefill engine; the TTFT is untouched."""
    p = EngineCost(tokens_per_s=4000.0, tpot_s=0.040)
    d = EngineCost(tokens_per_s=2000.0, running=4, tpot_s=0.060, tpot_added_s=0.005)
    link = LinkCost(fixed_s=0.03, bytes_per_s=1.25e9)
    assert decode_s(32, d) == pytest.approx(32 * (0.060 + 4 * 0.005 / 2))
    assert decode_s(32, d, stall_weight=0.0) == pytest.approx(32 * 0.060)
    assert decode_s(0, d) == 0.0 and decode_s(32, replace(d, tpot_s=None)) is None
    base = option_costs(500, kv(500), p, d, link, whole=True, stall_weight=1.0)
    priced = option_costs(500, kv(500), p, d, link, whole=True, stall_weight=1.0, out_tokens=32)
    assert [o.decode_s for o in priced] == [pytest.approx(decode_s(32, d)), pytest.approx(decode_s(32, d)),
                                            pytest.approx(32 * 0.040)]
    for b, o in zip(base, priced, strict=True):
        assert (o.path, o.ttft_s) == (b.path, b.ttft_s) and o.score_s == pytest.approx(b.score_s + o.decode_s)
    # an engine compared without a decode line: no option carries decode work (none is compared unfairly)
    unmeasured = option_costs(500, kv(500), replace(p, tpot_s=None), d, link, whole=True, out_tokens=32)
    assert [o.decode_s for o in unmeasured] == [0.0, 0.0, 0.0]
    # without whole, only the decode engine's line is needed
    assert option_costs(500, kv(500), replace(p, tpot_s=None), d, link, out_tokens=32)[0].decode_s > 0


def test_tpot_rises_with_the_prefill_load_and_the_decode_load() -> None:
    """TPOT = tpot_s / (1 - prefill share - decode tokens/s x tpot_added_s); unbounded at saturation."""
    from disagg.routecost import decode_step_s, prefill_tokens_share, tpot_with_prefills_s

    step = decode_step_s(16e9, 0.0, 1e12)                 # 16 GB of weights at 1 TB/s: 16 ms
    assert step == pytest.approx(0.016)
    engine = EngineCost(tokens_per_s=10_000.0, tpot_s=step, tpot_added_s=decode_step_s(0.0, 1e8, 1e12))
    assert tpot_with_prefills_s(engine, 0.0) == pytest.approx(0.016)
    shares = [prefill_tokens_share(t, engine) for t in (0, 2000, 5000, 8000)]
    assert shares == [0.0, 0.2, 0.5, 0.8]
    tpots = [tpot_with_prefills_s(engine, s) for s in shares]
    assert all(a < b for a, b in pairwise(tpots))
    assert tpots[2] == pytest.approx(0.032)                # half the time prefilling: twice the TPOT
    # 1,000 decode tokens/s, each request's KV adding 0.1 ms per step: 0.1 of the time more
    assert tpot_with_prefills_s(engine, 0.5, 1000.0) == pytest.approx(0.016 / 0.4)
    assert tpot_with_prefills_s(engine, 1.0) == float("inf")
    assert tpot_with_prefills_s(engine, 0.5, 5000.0) == float("inf")
    with pytest.raises(ValueError, match="no decode line"):
        tpot_with_prefills_s(EngineCost(tokens_per_s=1.0), 0.1)


def test_a_prompt_waits_for_room_in_a_full_kv_cache_soonest_frees_first() -> None:
    assert kv_wait_s(100, 200, ()) == 0.0
    assert kv_wait_s(100, 20, ((1.0, 50.0), (3.0, 50.0))) == 3.0      # 1 s frees 50 (30 short), 3 s the rest
    assert kv_wait_s(100, 20, ((1.0, 100.0), (3.0, 50.0))) == 1.0
    assert kv_wait_s(100, -50, ((1.0, 100.0),)) == float("inf")        # all of it would not hold the prompt
    full = EngineCost(tokens_per_s=1000.0, kv_free_tokens=0.0, kv_frees=((2.0, 4096.0),))
    assert full.kv_wait_s(1000) == 2.0
    assert full.ttft_s(1000) == pytest.approx(2.0 + 1.0)
    # the longest of the delays before the prompt starts counts: here the queue's 3 s
    assert replace(full, queued_tokens=3000.0).ttft_s(1000) == pytest.approx(3.0 + 1.0)
    # a capacity not known: nothing waits for KV
    assert EngineCost(tokens_per_s=1000.0).ttft_s(1000) == pytest.approx(1.0)


def test_a_split_waits_for_room_on_the_decode_engine_too() -> None:
    prefill = EngineCost(tokens_per_s=1000.0)
    decode = EngineCost(tokens_per_s=100.0, kv_free_tokens=0.0, kv_frees=((5.0, 2000.0),))
    link = LinkCost(fixed_s=0.01, bytes_per_s=1e9)
    assert split_ttft(1000, 1e6, prefill, link, decode) == pytest.approx(5.0 + 0.01 + 0.001)
    room = replace(decode, kv_free_tokens=1000.0)
    assert split_ttft(1000, 1e6, prefill, link, room) == pytest.approx(1.0 + 0.01 + 0.001)


def test_option_costs_take_each_engines_ttft_and_room_once_and_price_as_the_paths_alone() -> None:
    """option_costs hands split_ttft and ttft_s what it computed once; the options cost what the
    paths' own functions say, on engines with a queue, a busy line and a full KV cache."""
    prefill = EngineCost(tokens_per_s=1000.0, overhead_s=0.01, queued_tokens=300.0, busy_s=0.1,
                         kv_free_tokens=0.0, kv_frees=((0.7, 4096.0),), running=2, tpot_s=0.02)
    decode = EngineCost(tokens_per_s=500.0, overhead_s=0.02, queued_tokens=100.0, busy_s=0.05,
                        kv_free_tokens=100.0, kv_frees=((1.5, 4096.0),), running=3, tpot_s=0.03)
    link = LinkCost(fixed_s=0.01, bytes_per_s=1e8)
    n = 800
    by_path = {o.path: o.ttft_s for o in option_costs(n, kv(n), prefill, decode, link, whole=True)}
    assert by_path == {Option.SPLIT: split_ttft(n, kv(n), prefill, link, decode),
                       Option.LOCAL: local_ttft(n, decode), Option.WHOLE: whole_ttft(n, prefill)}
    assert decode.ttft_s(n, known_kv_wait_s=decode.kv_wait_s(n)) == decode.ttft_s(n) == pytest.approx(1.5 + 0.02 + 1.6)
