"""disagg.bench client/prompts/runner against the stand-in OpenAI server (see conftest.py)."""

from __future__ import annotations

import io
import math
from dataclasses import replace

import aiohttp
import pytest

from disagg.bench.client import request_body, send_request
from disagg.bench.metrics import failure_kind
from disagg.bench.progress import Progress
from disagg.bench.prompts import Prompt, build_prompts
from disagg.bench.runner import Step, Target, normalize_base_url, repeat_workload, run_sweep
from disagg.bench.slo import SLO
from disagg.bench.workload import Workload, class_sequence, parse_classes
from disagg.errors import DisaggError


def _workload(**kw: object) -> Workload:
    base: dict[str, object] = {"classes": parse_classes("short=40,long=400", output_len=5), "num_requests": 6,
                               "seed": 1}
    base.update(kw)
    return Workload(**base)  # type: ignore[arg-type]


def test_normalize_base_url() -> None:
    assert normalize_base_url("http://h:8000/v1/") == "http://h:8000"
    assert normalize_base_url("https://h") == "https://h"
    with pytest.raises(DisaggError, match="bad endpoint URL"):
        normalize_base_url("h:8000")


def test_request_body_completions_and_chat() -> None:
    p = Prompt(0, "short", "hello", 6, 7, exact=True)
    body = request_body(p, "m", _workload())
    assert body["max_tokens"] == 7 and body["ignore_eos"] is True and body["prompt"] == "hello"
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    chat = request_body(p, "m", _workload(api="chat", ignore_eos=False))
    assert chat["messages"] == [{"role": "user", "content": "hello"}] and chat["max_completion_tokens"] == 7
    assert "ignore_eos" not in chat


async def test_prompts_have_exact_token_counts(standin) -> None:
    w = _workload()
    async with aiohttp.ClientSession() as s:
        prompts = await build_prompts(s, [standin.url], standin.model, w, class_sequence(w))
        again = await build_prompts(s, [standin.url], standin.model, w, class_sequence(w))
        round2 = await build_prompts(s, [standin.url], standin.model, w, class_sequence(w), round_index=1)
        salted = await build_prompts(s, [standin.url], standin.model, replace(w, salt="q7-"), class_sequence(w))
    assert all(p.exact for p in prompts)
    # the stand-in counts characters + BOS
    assert [len(p.text) + 1 for p in prompts] == [w.klass(p.klass).input_len for p in prompts]
    assert [p.text for p in prompts] == [p.text for p in again]                 # seeded
    assert len({p.text[:12] for p in prompts}) == len(prompts)                  # unique first block
    assert not {p.text for p in prompts} & {p.text for p in round2}             # no cache hits across runs
    assert all(a.text != b.text for a, b in zip(prompts, salted, strict=True))  # ... nor across invocations
    assert [len(p.text) for p in salted] == [len(p.text) for p in prompts]


async def test_prompts_wait_out_a_busy_proxy(standin) -> None:
    standin.busy_tokenize = 5                   # a proxy at its max_concurrency answers 429 for a while
    w = _workload()
    async with aiohttp.ClientSession() as s:
        prompts = await build_prompts(s, [standin.url], standin.model, w, class_sequence(w))
    assert standin.busy_tokenize == 0 and all(p.exact for p in prompts)


async def test_prompts_fall_back_to_estimate_without_tokenize(standin) -> None:
    standin.tokenize = False
    w = _workload()
    async with aiohttp.ClientSession() as s:
        prompts = await build_prompts(s, [standin.url], standin.model, w, class_sequence(w), chars_per_token=2.0)
    assert not any(p.exact for p in prompts)
    assert [len(p.text) for p in prompts] == [2 * w.klass(p.klass).input_len for p in prompts]


async def test_prompts_reject_classes_beyond_max_model_len(standin) -> None:
    w = _workload(classes=parse_classes("huge=9999", output_len=10))
    async with aiohttp.ClientSession() as s:
        with pytest.raises(DisaggError, match="max_model_len is 10000"):
            await build_prompts(s, [standin.url], standin.model, w, class_sequence(w))


async def test_send_request_records_chunks_usage_and_errors(standin) -> None:
    standin.tpot = 0.01
    w = _workload()
    async with aiohttp.ClientSession() as s:
        ok = await send_request(s, standin.url + "/v1/completions", Prompt(0, "short", "abc", 4, 5, True),
                                standin.model, w, t0=0.0)
        bad = await send_request(s, standin.url + "/v1/completions", Prompt(1, "short", "FAIL", 5, 5, True),
                                 standin.model, w, t0=0.0)
    assert ok.success and ok.output_tokens == 5 and ok.prompt_tokens == 4 and len(ok.chunk_times) == 5
    # a chunk's time is when it arrived: on a loaded machine one late chunk makes the next gap short (or
    # nil, two chunks in one read), so the check is that the times span most of the 4 programmed 10 ms steps
    assert all(gap >= 0 for gap in ok.itls) and sum(ok.itls) >= 0.03
    assert not bad.success and bad.error is not None and bad.error.startswith("HTTP 500")


async def test_send_request_records_connection_errors() -> None:
    async with aiohttp.ClientSession() as s:
        rec = await send_request(s, "http://127.0.0.1:9/v1/completions", Prompt(0, "a", "x", 2, 2, False),
                                 "m", _workload(), t0=0.0)
    assert not rec.success and rec.error and "Connect" in rec.error


@pytest.mark.parametrize("api", ["completions", "chat"])
async def test_open_loop_sweep_measures_programmed_latencies(standin, api: str) -> None:
    standin.prefill_tokens_per_s = 10_000.0      # long (400 tokens) -> ~45 ms TTFT, short ~9 ms
    standin.tpot = 0.01
    w = _workload(api=api, num_requests=8)
    result = await run_sweep(Target(standin.url), w, [Step(rate=50.0), Step(rate=math.inf)],
                             slo=SLO(ttft=1.0, tpot=0.5), progress=False)
    assert result.model == standin.model and len(result.runs) == 2
    run = result.runs[0]
    assert len(run.records) == 8 and all(r.success for r in run.records)
    long_ttft = run.metrics["long"].ttft.mean
    short_ttft = run.metrics["short"].ttft.mean
    assert 0.04 < long_ttft < 0.5 and short_ttft < long_ttft
    # a request's TPOT counts from its first chunk's arrival: a late one takes up to one of the 4 steps
    assert 0.0075 <= run.metrics["all"].tpot.mean < 0.1
    assert run.metrics["all"].total_output_tokens == 8 * 5
    assert run.metrics["all"].slo_attainment == 1.0 and run.exact_prompts
    assert run.loadavg is not None and all(v >= 0 for v in run.loadavg)    # the machine's load, start and end
    assert run.to_dict()["loadavg"] == list(run.loadavg)
    # the first run's sends follow the schedule: spread over ~8/50 s, not all at t=0
    assert max(r.send for r in run.records) > 0.08
    assert result.runs[1].x == pytest.approx(result.runs[1].metrics["all"].request_throughput)
    bodies = standin.bodies[1:]                                 # [0] is the warm-up
    assert all(b["model"] == standin.model and b.get("ignore_eos") for b in bodies)


async def test_closed_loop_keeps_concurrency(standin) -> None:
    standin.tpot = 0.005
    w = _workload(arrival="closed", concurrency=2, num_requests=6)
    result = await run_sweep(Target(standin.url, tokenize_urls=None), w, [Step(concurrency=2)], progress=False)
    recs = result.runs[0].records
    assert len(recs) == 6 and all(r.success for r in recs)
    for r in recs:                                              # never more than 2 in flight
        assert r.end is not None
        in_flight = sum(1 for o in recs if o.send <= r.send < (o.end or 0))
        assert in_flight <= 2


async def test_duration_bound_stops_sending(standin) -> None:
    w = _workload(num_requests=50, duration_s=0.3)
    result = await run_sweep(Target(standin.url), w, [Step(rate=20.0)], progress=False)
    assert 1 <= len(result.runs[0].records) < 50


async def test_warm_up_failure_names_the_endpoint() -> None:
    with pytest.raises(DisaggError, match=r"cannot reach http://127\.0\.0\.1:9/v1/models"):
        await run_sweep(Target("http://127.0.0.1:9"), _workload(), [Step(rate=1.0)], progress=False)


def test_progress_prints_deciles_when_not_a_tty() -> None:
    out = io.StringIO()
    bar = Progress(20, "rate 1/s", stream=out)
    for i in range(20):
        bar.update(ok=i != 3)
    bar.close()
    lines = out.getvalue().splitlines()
    assert 10 <= len(lines) <= 11 and lines[-1].startswith("rate 1/s [" + "#" * 30 + "] 20/20 (1 failed)")


async def test_repeats_run_each_step_back_to_back_with_fresh_prompts(standin) -> None:
    w = _workload(num_requests=4, salt="s-")
    result = await run_sweep(Target(standin.url), w, [Step(rate=200.0), Step(rate=400.0)], progress=False,
                             repeats=3)
    assert result.repeats == 3 and result.to_dict()["repeats"] == 3
    assert [(r.step.rate, r.repeat) for r in result.runs] == [(200.0, 0), (200.0, 1), (200.0, 2),
                                                              (400.0, 0), (400.0, 1), (400.0, 2)]
    assert [r.to_dict()["repeat"] for r in result.runs] == [0, 1, 2, 0, 1, 2]
    prompts = [b["prompt"] for b in standin.bodies[1:]]          # [0] is the warm-up
    assert len(prompts) == 24 and len({p[:14] for p in prompts}) == 24, "no prompt shares its tag"
    # repeat k: seed + k and its own salt; repeat 0 is the workload as given (a single run is unchanged)
    assert repeat_workload(w, 0) is w
    assert (repeat_workload(w, 2).seed, repeat_workload(w, 2).salt) == (3, "s-r2.")
    first_tags = [p.split("]")[0] for p in prompts[:4]]
    assert all(t.startswith("[s-1-0-") for t in first_tags)
    assert all(p.startswith("[s-r1.2-0-") for p in prompts[4:8])
    with pytest.raises(DisaggError, match="repeats must be at least 1"):
        await run_sweep(Target(standin.url), w, [Step(rate=1.0)], progress=False, repeats=0)


async def test_refusals_count_as_failures_by_status(standin) -> None:
    standin.refuse = [429, 429, 503]             # what the proxy answers at its cap / with no healthy backend
    w = _workload(num_requests=8)
    result = await run_sweep(Target(standin.url), w, [Step(rate=400.0)], progress=False, warmup=0)
    m = result.runs[0].metrics["all"]
    assert (m.completed, m.failed) == (5, 3)
    assert m.failures == {"HTTP 429": 2, "HTTP 503": 1}
    assert m.to_dict()["failures"] == {"HTTP 429": 2, "HTTP 503": 1}
    assert sum(sum(result.runs[0].metrics[k].failures.values()) for k in ("short", "long")) == 3


def test_failure_kinds() -> None:
    assert failure_kind("HTTP 429: {\"error\": ...}") == "HTTP 429"
    assert failure_kind("stream error: {}") == "stream"
    assert failure_kind("the stream ended without a token chunk") == "stream"
    assert failure_kind("TimeoutError: ") == "timeout"
    assert failure_kind("ClientConnectorError: Cannot connect") == "connection"
    assert failure_kind("ServerDisconnectedError: gone") == "connection"
    assert failure_kind("SSEError: bad") == "other"
