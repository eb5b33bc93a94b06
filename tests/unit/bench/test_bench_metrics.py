"""disagg.bench.metrics: the arithmetic, checked by hand against vLLM bench's definitions."""

from __future__ import annotations

import random

import numpy as np
import pytest

from disagg.bench.metrics import (
    Distribution,
    compute_metrics,
    meets_slo,
    metrics_by_class,
    missed_limits,
    percentile,
    pooled_itls,
    tpot,
)
from disagg.bench.records import RequestRecord
from disagg.bench.slo import SLO


def test_percentile_hand_checked() -> None:
    # linear interpolation between closest ranks: rank = (n - 1) * p / 100
    assert percentile([4, 1, 3, 2], 50) == pytest.approx(2.5)
    assert percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)     # rank 2.7 -> 3 + 0.7
    assert percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)    # rank 2.97
    assert percentile([1, 2, 3, 4], 0) == 1
    assert percentile([1, 2, 3, 4], 100) == 4
    assert percentile([5.0], 99) == 5.0
    assert percentile([], 50) == 0.0                              # vLLM reports 0 for no data
    with pytest.raises(ValueError):
        percentile([1.0], 101)


@pytest.mark.parametrize("n", [1, 2, 7, 100, 1001])
def test_percentile_matches_numpy_default(n: int) -> None:
    rng = random.Random(n)
    values = [rng.expovariate(3.0) for _ in range(n)]
    for p in (0, 1, 25, 50, 90, 99, 99.9, 100):
        assert percentile(values, p) == pytest.approx(float(np.percentile(values, p)), rel=1e-12, abs=1e-15)


def test_tpot_excludes_first_token() -> None:
    assert tpot(e2el=1.0, ttft=0.2, output_tokens=5) == pytest.approx(0.2)   # 0.8 s / 4 tokens
    assert tpot(e2el=0.5, ttft=0.2, output_tokens=2) == pytest.approx(0.3)
    assert tpot(e2el=2.0, ttft=2.0, output_tokens=1) is None
    assert tpot(e2el=2.0, ttft=2.0, output_tokens=0) is None


def test_meets_slo_treats_missing_tpot_as_zero() -> None:
    slo = SLO(ttft=1.0, tpot=0.1)
    assert meets_slo(slo, ttft=1.0, tpot_s=0.1, e2el=9.0)          # limits are inclusive
    assert meets_slo(slo, ttft=0.5, tpot_s=None, e2el=9.0)
    assert not meets_slo(slo, ttft=1.01, tpot_s=0.0, e2el=1.0)
    assert not meets_slo(slo, ttft=0.1, tpot_s=0.11, e2el=1.0)
    assert not meets_slo(SLO(e2el=2.0), ttft=0.1, tpot_s=0.1, e2el=2.5)


def test_missed_limits_names_every_limit_crossed_in_order() -> None:
    slo = SLO(ttft=1.0, tpot=0.1, e2el=5.0)
    assert missed_limits(slo, ttft=1.0, tpot_s=0.1, e2el=5.0) == []
    assert missed_limits(slo, ttft=1.5, tpot_s=0.2, e2el=6.0) == ["ttft", "tpot", "e2el"]
    assert missed_limits(slo, ttft=0.5, tpot_s=None, e2el=6.0) == ["e2el"]
    assert missed_limits(SLO(tpot=0.1), ttft=9.0, tpot_s=0.11, e2el=99.0) == ["tpot"]   # unset limits never miss


def _records() -> list[RequestRecord]:
    return [
        # ttft 0.5, e2el 0.8, 4 tokens -> tpot 0.1, itls .1 .1 .1
        RequestRecord(0, "short", send=0.0, prompt_tokens=10, output_tokens=4, chunk_times=[0.5, 0.6, 0.7, 0.8]),
        # ttft 0.2, e2el 0.5, 2 tokens -> tpot 0.3, itl .3
        RequestRecord(1, "short", send=1.0, prompt_tokens=20, output_tokens=2, chunk_times=[1.2, 1.5]),
        # ttft 2.0, e2el 2.0, 1 token -> no tpot (0 for goodput)
        RequestRecord(2, "long", send=2.0, prompt_tokens=30, output_tokens=1, chunk_times=[4.0]),
        # failed
        RequestRecord(3, "long", send=3.0, prompt_tokens=40, error="HTTP 500: boom"),
    ]


def test_compute_metrics_hand_checked() -> None:
    m = compute_metrics(_records(), duration_s=5.0, slo=SLO(ttft=1.0, tpot=0.2))
    assert (m.requests, m.completed, m.failed) == (4, 3, 1)
    assert m.total_input_tokens == 60 and m.total_output_tokens == 7          # failed request not counted
    assert m.request_throughput == pytest.approx(0.6)
    assert m.output_throughput == pytest.approx(1.4)
    assert m.total_token_throughput == pytest.approx(13.4)
    assert m.ttft.mean == pytest.approx(0.9) and m.ttft.median == pytest.approx(0.5)
    assert m.tpot.count == 2 and m.tpot.mean == pytest.approx(0.2)           # the 1-token request is left out
    assert m.e2el.mean == pytest.approx((0.8 + 0.5 + 2.0) / 3)
    # ITLs pooled over requests: .1 .1 .1 .3
    assert m.itl.count == 4 and m.itl.mean == pytest.approx(0.15)
    assert m.itl.median == pytest.approx(0.1) and m.itl.p(99) == pytest.approx(0.294)
    # only request 0 meets ttft<=1 and tpot<=0.2 (1 has tpot .3, 2 has ttft 2)
    assert m.good == 1 and m.goodput == pytest.approx(0.2) and m.slo_attainment == pytest.approx(0.25)


def test_goodput_mixed_outcomes_with_looser_ttft() -> None:
    m = compute_metrics(_records(), duration_s=5.0, slo=SLO(ttft=2.5, tpot=0.2))
    # 0 good; 1 misses tpot; 2 good (one token: tpot 0); 3 failed
    assert m.good == 2 and m.goodput == pytest.approx(0.4) and m.slo_attainment == pytest.approx(0.5)
    only_e2el = compute_metrics(_records(), duration_s=5.0, slo=SLO(e2el=0.6))
    assert only_e2el.good == 1                                                  # request 1 (0.5 s)


def test_no_slo_reports_no_goodput() -> None:
    m = compute_metrics(_records(), duration_s=5.0)
    assert m.good is None and m.goodput is None and m.slo_attainment is None


def test_metrics_by_class_uses_run_duration() -> None:
    by = metrics_by_class(_records(), duration_s=5.0, slo=SLO(ttft=1.0, tpot=0.2))
    assert set(by) == {"all", "short", "long"}
    assert by["short"].completed == 2 and by["short"].request_throughput == pytest.approx(0.4)
    assert by["short"].goodput == pytest.approx(0.2) and by["short"].slo_attainment == pytest.approx(0.5)
    assert by["long"].completed == 1 and by["long"].failed == 1 and by["long"].good == 0
    assert by["long"].slo_attainment == 0.0


def test_pooled_itls_skip_failed_requests() -> None:
    recs = _records()
    recs[3].chunk_times = [3.5, 3.9]        # streamed, then failed: not counted (vLLM drops failed requests)
    assert pooled_itls(recs) == pytest.approx([0.1, 0.1, 0.1, 0.3])


def test_distribution_of_empty_is_zero_and_std_is_population() -> None:
    d = Distribution.of([], (50.0, 99.0))
    assert (d.count, d.mean, d.std, d.median, d.p(99)) == (0, 0.0, 0.0, 0.0, 0.0)
    d = Distribution.of([1.0, 3.0])
    assert d.std == pytest.approx(1.0)                                      # numpy's np.std (ddof=0)
    assert d.to_dict()["p90_ms"] == pytest.approx(2800.0)


def test_zero_duration_is_rejected() -> None:
    with pytest.raises(ValueError, match="duration"):
        compute_metrics(_records(), duration_s=0.0)
