"""disagg.bench.prefill: isolated requests, the rate, the merging writer, the probe."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from disagg.bench.prefill import isolated, prefill_rate_from_records, probe_prefill_rate
from disagg.bench.records import RequestRecord
from disagg.errors import DisaggError
from disagg.measurements import store_prefill


def _rec(i: int, send: float, first: float, end: float, tokens: int) -> RequestRecord:
    return RequestRecord(i, "c", send=send, prompt_tokens=tokens, output_tokens=2, chunk_times=[first, end])


def test_isolated_requests() -> None:
    recs = [
        _rec(0, 0.0, 1.0, 2.0, 1000),     # alone
        _rec(1, 3.0, 4.0, 5.0, 1000),     # request 2 is sent before 1's first token: not alone
        _rec(2, 3.5, 5.5, 6.0, 1000),     # 1 is still in flight when 2 is sent: not alone
        _rec(3, 7.0, 7.5, 9.0, 100),      # alone
    ]
    assert [r.index for r in isolated(recs)] == [0, 3]


def test_prefill_rate_uses_longest_isolated_prompts() -> None:
    recs = [_rec(0, 0.0, 1.0, 2.0, 1000), _rec(1, 3.0, 3.5, 4.0, 600), _rec(2, 5.0, 5.1, 6.0, 100)]
    # 1000 and 600 tokens are >= half the longest; the 100-token prompt is left out
    rate, used = prefill_rate_from_records(recs)  # type: ignore[misc]
    assert used == 2 and rate == pytest.approx(1600 / 1.5)
    assert prefill_rate_from_records([_rec(0, 0.0, 1.0, 2.0, 10), _rec(1, 0.5, 1.2, 2.0, 10)]) is None


def test_record_prefill_rate_merges(tmp_path: Path) -> None:
    when = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC).isoformat()
    path = store_prefill(tmp_path, "tiny", "spark-a", 1234.5, "probe A", measured_at=when)
    store_prefill(tmp_path, "tiny", "spark-b", 99.0, "probe B", measured_at=when)
    store_prefill(tmp_path, "llama", "spark-a", 5.0, "probe C", measured_at=when)
    store_prefill(tmp_path, "tiny", "spark-a", 2000.0, "probe A2", measured_at=when)   # replaces
    assert path == tmp_path / "measurements" / "prefill.json"
    data = json.loads(path.read_text())
    assert data == {
        "tiny": {"spark-a": {"prompt_tokens_per_s": 2000.0, "measured_at": "2026-01-02T03:04:05+00:00",
                             "source": "probe A2", "dtype": "auto"},
                 "spark-b": {"prompt_tokens_per_s": 99.0, "measured_at": "2026-01-02T03:04:05+00:00",
                             "source": "probe B", "dtype": "auto"}},
        "llama": {"spark-a": {"prompt_tokens_per_s": 5.0, "measured_at": "2026-01-02T03:04:05+00:00",
                              "source": "probe C", "dtype": "auto"}}}


def test_record_prefill_rate_refuses_a_corrupt_file(tmp_path: Path) -> None:
    (tmp_path / "measurements").mkdir()
    (tmp_path / "measurements" / "prefill.json").write_text("{not json")
    with pytest.raises(DisaggError, match=r"prefill\.json:1: invalid JSON"):
        store_prefill(tmp_path, "tiny", "h", 1.0, "x")


async def test_probe_measures_the_programmed_prefill_rate(standin) -> None:
    standin.base_ttft = 0.0
    standin.prefill_tokens_per_s = 20_000.0
    rate = await probe_prefill_rate(standin.url, standin.model, prompt_tokens=2000, count=2)
    assert 5_000 < rate <= 20_000                       # the stand-in's rate, less HTTP overhead
    assert [b["max_tokens"] for b in standin.bodies] == [1, 1, 1]
