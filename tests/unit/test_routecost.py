"""The routing arithmetic (disagg.routecost): predicted TTFT per path and the idle break-even."""

from __future__ import annotations

import pytest

from disagg.routecost import (
    DEFAULT_HANDOFF_FIXED_S,
    HANDOFF_FIXED_S,
    EngineCost,
    LinkCost,
    Option,
    break_even_tokens,
    cheapest,
    handoff_fixed_s,
    local_ttft,
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


def test_ties_go_local_then_split_then_whole() -> None:
    e = EngineCost(tokens_per_s=1000.0)
    opts = option_costs(100, 0.0, e, e, LinkCost(0.0, 1e12), whole=True)
    assert {o.score_s for o in opts} == {opts[0].score_s}
    assert cheapest(opts).path is Option.LOCAL


def test_fixed_cost_per_connector_is_the_measured_one() -> None:
    for connector, fixed in HANDOFF_FIXED_S.items():
        assert handoff_fixed_s(connector) == fixed > 0
    assert handoff_fixed_s("mooncake") == DEFAULT_HANDOFF_FIXED_S == max(HANDOFF_FIXED_S.values())
