"""disagg.bench.prefill: isolated requests, the rate, the merging writer, the probe."""

from __future__ import annotations

import json
import statistics
from datetime import UTC, datetime
from pathlib import Path

import pytest

from disagg.bench.prefill import (
    DecodePoint,
    fit_decode,
    isolated,
    prefill_rate_from_records,
    probe_decode_step,
    probe_prefill_rate,
)
from disagg.bench.records import RequestRecord
from disagg.errors import DisaggError, StateError
from disagg.measurements import (
    decode_path,
    fit_decode_step,
    load_decode,
    lookup_decode,
    lookup_prefill,
    store_decode,
    store_prefill,
)


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
    kind = {"dtype": "auto", "connector": ""}        # the engine's connector not said: unknown
    assert data == {
        "tiny": {"spark-a": {"prompt_tokens_per_s": 2000.0, "measured_at": "2026-01-02T03:04:05+00:00",
                             "source": "probe A2", "host": "spark-a", **kind},
                 "spark-b": {"prompt_tokens_per_s": 99.0, "measured_at": "2026-01-02T03:04:05+00:00",
                             "source": "probe B", "host": "spark-b", **kind}},
        "llama": {"spark-a": {"prompt_tokens_per_s": 5.0, "measured_at": "2026-01-02T03:04:05+00:00",
                              "source": "probe C", "host": "spark-a", **kind}}}
    # an engine with a KV connector is kept apart from a colocated one of the same host
    store_prefill(tmp_path, "tiny", "spark-a", 1000.0, "split probe", measured_at=when, connector="nixl")
    store_prefill(tmp_path, "tiny", "spark-a", 2500.0, "colocated probe", measured_at=when, connector="none")
    data = json.loads(path.read_text())
    assert data["tiny"]["spark-a [nixl]"]["prompt_tokens_per_s"] == 1000.0
    assert data["tiny"]["spark-a"]["prompt_tokens_per_s"] == 2500.0       # replaced the unknown kind


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


def test_a_decode_step_is_the_line_through_two_context_lengths() -> None:
    assert fit_decode_step([(1e6, 0.005), (3e6, 0.007), (1e6, 0.005), (3e6, 0.007)]) == (
        pytest.approx(0.004), pytest.approx(1e-9))
    # a slope below 0 is noise: the step is the mean, nothing per byte
    assert fit_decode_step([(1e6, 0.006), (3e6, 0.004)]) == (pytest.approx(0.005), 0.0)
    with pytest.raises(ValueError, match="two context lengths"):
        fit_decode_step([(1e6, 0.005), (1e6, 0.006)])
    # the probe's points: the mean context of 64 answer tokens is the prompt + 32 tokens
    points = [DecodePoint(64, 64, 0.005), DecodePoint(992, 64, 0.009)]
    fixed, per_byte, xy = fit_decode(points, lambda n: n * 1000.0)
    assert xy == [(96_000.0, 0.005), (1_024_000.0, 0.009)]
    assert per_byte == pytest.approx(0.004 / 928_000) and fixed == pytest.approx(0.005 - 96_000 * 0.004 / 928_000)


def test_decode_steps_are_kept_per_host_and_engine_kind(tmp_path: Path) -> None:
    when = "2026-12-05T10:00:00+00:00"
    path = store_decode(tmp_path, "tiny", "gamer", 0.0045, 1.2e-10, "colocated probe", points=[(1e6, 0.00462)],
                        measured_at=when, connector="none")
    store_decode(tmp_path, "tiny", "gamer", 0.02, 3e-10, "split probe", measured_at=when, connector="nixl")
    assert path == decode_path(tmp_path) == tmp_path / "measurements" / "decode.json"
    raw = json.loads(path.read_text())
    assert raw["tiny"]["gamer"] == {"fixed_s": 0.0045, "per_kv_byte_s": 1.2e-10, "points": [[1e6, 0.00462]],
                                    "dtype": "auto", "host": "gamer", "connector": "none", "measured_at": when,
                                    "source": "colocated probe"}
    assert set(raw["tiny"]) == {"gamer", "gamer [nixl]"}
    plain = lookup_decode(tmp_path, "tiny", "gamer")
    assert plain is not None and plain.step_s(1e8) == pytest.approx(0.0045 + 0.012) and plain.date == "2026-12-05"
    assert lookup_decode(tmp_path, "tiny", "gamer", connector="nixl").fixed_s == 0.02  # type: ignore[union-attr]
    # another kind of the same host stands in (its connector says so); another dtype does not
    assert lookup_decode(tmp_path, "tiny", "gamer", connector="socket").connector == "none"  # type: ignore[union-attr]
    assert lookup_decode(tmp_path, "tiny", "gamer", "float32") is None
    assert lookup_decode(tmp_path, "tiny", "workstation") is None
    assert set(load_decode(tmp_path)["tiny"]) == {"gamer", "gamer [nixl]"}
    with pytest.raises(ValueError):
        store_decode(tmp_path, "tiny", "gamer", 0.0, 1e-10, "x")
    path.write_text('{"tiny": {"gamer": {"fixed_s": 0.004}}}')
    with pytest.raises(StateError, match=r"decode\.json: tiny\.gamer\.per_kv_byte_s: Field required"):
        load_decode(tmp_path)


def test_a_prefill_rate_of_the_engine_s_kind_comes_first(tmp_path: Path) -> None:
    store_prefill(tmp_path, "tiny", "gamer", 1246.0, "split probe", connector="nixl")
    assert lookup_prefill(tmp_path, "tiny", "gamer").connector == "nixl"  # type: ignore[union-attr]
    store_prefill(tmp_path, "tiny", "gamer", 2862.0, "old bench serve")        # kind unknown
    assert lookup_prefill(tmp_path, "tiny", "gamer").prompt_tokens_per_s == 2862.0  # type: ignore[union-attr]
    assert lookup_prefill(tmp_path, "tiny", "gamer", connector="nixl").prompt_tokens_per_s == 1246.0  # type: ignore[union-attr]
    store_prefill(tmp_path, "tiny", "gamer", 2900.0, "colocated probe", connector="none")
    assert lookup_prefill(tmp_path, "tiny", "gamer").prompt_tokens_per_s == 2900.0  # type: ignore[union-attr]


async def test_the_decode_probe_measures_the_programmed_steps(standin) -> None:
    """Two short and two long prompts, in turn, one at a time, 64 tokens each (ignore_eos): each
    request's TPOT is the stand-in's programmed step at its prompt length."""
    standin.base_ttft, standin.tpot, standin.tpot_per_prompt_token = 0.0, 0.002, 1e-5
    points = await probe_decode_step(standin.url, standin.model, long_tokens=400, count=2,
                                     headers={"Authorization": "Bearer ek"})
    assert [(p.prompt_tokens, p.output_tokens) for p in points] == [(64, 64), (400, 64)] * 2
    assert [b["max_tokens"] for b in standin.bodies] == [64] * 4 and all(b["ignore_eos"] for b in standin.bodies)
    assert standin.authorizations == ["Bearer ek"] * 4
    for p in points:      # asyncio's sleeps on a loaded machine: over, by up to a step (a late first chunk
        step = 0.002 + 1e-5 * p.prompt_tokens       # shortens the gaps after it by as much)
        assert 0.95 * step <= p.tpot_s < 2 * step + 0.005
    short, long = (statistics.median(p.tpot_s for p in points if p.prompt_tokens == n) for n in (64, 400))
    assert long > short       # the step grows with the context, as programmed
    with pytest.raises(ValueError):
        await probe_decode_step(standin.url, standin.model, long_tokens=64)


COLOCATED = """\
name: probe
run_dir: {run_dir}
model: {{path: disagg:tiny}}
engine: vllm
link: {{type: loopback}}
proxy: {{host: 127.0.0.1, port: 18000}}
hosts:
  box: {{address: 127.0.0.1, device: cpu}}
roles:
  both:
    - {{host: box, port: {engine_port}}}
"""


async def test_bench_prefill_probes_a_running_topology_s_engines_with_the_run_s_key(
        standin, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``disagg bench prefill TOPOLOGY``: straight to the engine with the run's key, its prefill rate
    and decode step stored where ``disagg plan`` reads them (an engine without a KV connector)."""
    import asyncio

    from disagg.cli import main

    standin.model, standin.base_ttft, standin.tpot, standin.tpot_per_prompt_token = "tiny", 0.0, 0.002, 1e-5
    file = tmp_path / "probe.yaml"
    file.write_text(COLOCATED.format(run_dir=tmp_path / "run", engine_port=standin.url.rsplit(":", 1)[1]))
    monkeypatch.delenv("DISAGG_ENGINE_KEY", raising=False)
    assert await asyncio.to_thread(main, ["bench", "prefill", str(file)]) != 0
    assert "set DISAGG_ENGINE_KEY to the same value for `disagg up" in capsys.readouterr().err
    assert standin.bodies == [], "nothing is sent without the run's key"
    monkeypatch.setenv("DISAGG_ENGINE_KEY", "ek")
    report = tmp_path / "probe.json"
    assert await asyncio.to_thread(main, ["bench", "prefill", str(file), "--prompt-tokens", "300", "--count", "1",
                                          "--json", str(report)]) == 0
    # a warm-up and the probe at 300 tokens, the same at 37; 2 decodes
    assert [b["max_tokens"] for b in standin.bodies] == [1, 1, 1, 1, 64, 64]
    assert set(standin.authorizations) == {"Bearer ek"}
    rate = lookup_prefill(tmp_path / "run", "tiny", "box")
    decode = lookup_decode(tmp_path / "run", "tiny", "box")
    assert rate is not None and rate.connector == "none" and "disagg bench prefill" in rate.source
    assert [n for n, _ in rate.points] == [300.0, 37.0] and rate.fit() is not None
    assert decode is not None and decode.connector == "none" and len(decode.points) == 2
    assert decode.per_kv_byte_s > 0                 # the stand-in's step grows with the prompt
    doc = json.loads(report.read_text())
    assert doc["hosts"]["box"]["decode"]["stored"] is True and "handoff" not in doc
    assert "box (both[0], none): prefill" in capsys.readouterr().err


def test_prefill_points_are_stored_and_checked(tmp_path: Path) -> None:
    store_prefill(tmp_path, "tiny", "gamer", 1787.0, "probe", connector="none",
                  points=[(2048.0, 1.146), (256.0, 0.083)])
    found = lookup_prefill(tmp_path, "tiny", "gamer")
    assert found is not None and found.points == ((2048.0, 1.146), (256.0, 0.083))
    path = tmp_path / "measurements" / "prefill.json"
    path.write_text('{"tiny": {"gamer": {"prompt_tokens_per_s": 1.0, "points": [[256, -1]]}}}')
    with pytest.raises(StateError, match=r"tiny\.gamer\.points"):
        lookup_prefill(tmp_path, "tiny", "gamer")
