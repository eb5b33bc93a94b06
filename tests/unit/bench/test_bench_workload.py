"""disagg.bench.workload, slo and records: parsing, class mix, arrival schedules."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from disagg.bench.records import RequestRecord
from disagg.bench.slo import SLO, parse_duration, parse_slo
from disagg.bench.workload import PromptClass, Workload, arrival_offsets, class_sequence, parse_classes


def test_parse_slo() -> None:
    assert parse_slo("ttft=2s,tpot=100ms") == SLO(ttft=2.0, tpot=0.1)
    assert parse_slo("e2el=1.5, TTFT=250ms") == SLO(ttft=0.25, e2el=1.5)
    assert parse_slo("").empty and parse_slo(None).empty
    assert parse_slo("ttft=2s,tpot=100ms").describe() == "ttft<=2000ms, tpot<=100ms"
    for bad in ("ttft", "itl=1s", "ttft=fast", "ttft=1s,ttft=2s"):
        with pytest.raises(ValueError):
            parse_slo(bad)
    assert parse_duration("0.5") == 0.5


def test_parse_classes() -> None:
    assert parse_classes(None, output_len=32) == (PromptClass("short", 128, 32), PromptClass("medium", 512, 32),
                                                  PromptClass("long", 2048, 32))
    assert parse_classes("a=10,b=20:5@2") == (PromptClass("a", 10, 64), PromptClass("b", 20, 5, 2.0))
    for bad in ("a", "a=x", "=10", "a=10:y"):
        with pytest.raises(ValueError, match="NAME=INPUT"):
            parse_classes(bad)


def test_workload_validation() -> None:
    cls = (PromptClass("a", 10, 5),)
    with pytest.raises(ValueError, match="concurrency"):
        Workload(cls, arrival="closed")
    with pytest.raises(ValueError, match="unique"):
        Workload((PromptClass("all", 10, 5),))
    with pytest.raises(ValueError, match="arrival"):
        Workload(cls, arrival="uniform")


def test_class_sequence_is_proportional_and_seeded() -> None:
    w = Workload(parse_classes("s=10,m=20,l=30@2"), num_requests=10, seed=7)
    seq = class_sequence(w)
    # weights 1:1:2 of 10 -> 2.5, 2.5, 5 -> largest remainder gives 3, 2, 5 (ties to the first)
    assert Counter(seq) == {"s": 3, "m": 2, "l": 5}
    assert seq == class_sequence(w)                       # same seed, same order
    assert seq != class_sequence(Workload(w.classes, num_requests=10, seed=8))


def test_arrival_offsets_follow_vllm() -> None:
    offs = arrival_offsets(50, rate=5.0, burstiness=1.0, seed=3)
    assert len(offs) == 50 and offs == sorted(offs)
    assert offs[-1] == pytest.approx(10.0)                # rescaled: last send at n / rate
    # same draws as vllm bench serve: np.random gamma gaps, cumulated, rescaled
    rng = np.random.RandomState(3)
    gaps = [rng.gamma(shape=1.0, scale=1 / 5.0) for _ in range(50)]
    expected = np.cumsum(gaps) * (10.0 / sum(gaps))
    assert offs == pytest.approx(list(expected))
    assert arrival_offsets(3, math.inf) == [0.0, 0.0, 0.0]
    assert arrival_offsets(4, 2.0, burstiness=math.inf) == pytest.approx([0.5, 1.0, 1.5, 2.0])
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0)


def test_burstiness_changes_gap_spread() -> None:
    def cv(b: float) -> float:
        offs = np.array(arrival_offsets(4000, 10.0, burstiness=b, seed=1))
        gaps = np.diff(offs)
        return float(gaps.std() / gaps.mean())
    # gamma shape k has coefficient of variation 1/sqrt(k)
    assert cv(0.25) == pytest.approx(2.0, rel=0.15)
    assert cv(1.0) == pytest.approx(1.0, rel=0.1)
    assert cv(4.0) == pytest.approx(0.5, rel=0.1)


def test_record_roundtrip_and_properties() -> None:
    rec = RequestRecord(3, "long", send=1.0, prompt_tokens=7, output_tokens=3, chunk_times=[1.5, 1.75, 2.0])
    assert rec.success and rec.ttft == 0.5 and rec.e2el == 1.0 and rec.itls == [0.25, 0.25]
    assert RequestRecord.from_dict(rec.to_dict()) == rec
    failed = RequestRecord(4, "long", send=1.0, prompt_tokens=7, error="boom")
    assert not failed.success and failed.ttft is None and failed.e2el is None
    assert not RequestRecord(5, "x", send=0.0, prompt_tokens=1).success      # no chunk, no error: not a success


def test_a_trace_becomes_length_classes_and_a_rate(tmp_path) -> None:
    """``disagg plan --trace``: classes by prompt length (medians, shares), lengths cut to the model,
    and the rate from the arrivals."""
    from disagg.bench.trace import load_trace
    from disagg.bench.workload import trace_length_classes, trace_rate

    f = tmp_path / "t.csv"
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    lengths = [(100, 10), (200, 30), (150, 20), (3000, 200), (9000, 500)]
    rows += [f"2023-11-16 18:00:{i * 2:02d}.0000000,{n},{m}" for i, (n, m) in enumerate(lengths)]
    f.write_text("\n".join(rows) + "\n")
    trace = load_trace(f)
    classes = trace_length_classes(trace, max_model_len=4096)
    # 9,000 tokens are cut to 4,095 (one answer token left) and so join the 1,024-4,095 bucket
    assert [(c.name, c.input_len, c.output_len, c.weight) for c in classes] == [
        ("<256", 150, 20, 0.6), ("1024-4095", 4095, 200, 0.4)]
    uncut = trace_length_classes(trace)
    assert [(c.name, c.input_len, c.weight) for c in uncut][1:] == [("1024-4095", 3000, 0.2), ("4096-16383", 9000, 0.2)]
    assert trace_rate(trace) == pytest.approx(4 / 8)         # 5 requests over 8 s
    assert trace_rate(trace, 2.0) == pytest.approx(1.0)
