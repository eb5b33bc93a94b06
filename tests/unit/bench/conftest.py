"""Fixtures for the bench tests: a stand-in OpenAI streaming server.

The stand-in (NOT a real engine) exists because the unit tests must run without
vLLM: it answers /v1/models, streaming /v1/completions and
/v1/chat/completions with ``usage``, and vLLM's /tokenize and /detokenize with
a character-level tokenizer (one token per character, plus one BOS). Its
timing is programmed: TTFT = base + prompt tokens / prefill rate, then one
token every ``tpot`` (+ ``tpot_per_prompt_token`` x prompt tokens) seconds, so the bench's measurements can be checked
against known values. Requests whose prompt contains ``FAIL`` get HTTP 500;
``refuse`` lists statuses (429, 503) to answer the next generation requests
with, as the disagg proxy refuses them. With ``routes`` (the proxy's own
:class:`~disagg.proxy.metrics.ProxyMetrics`, so the series names are the real
ones) it serves ``GET /metrics`` and routes like a proxy would: prompts under
``split_from`` tokens ``local``, others ``split`` (said in ``X-Disagg-Route``),
predicting ``predict_factor`` x the programmed TTFT; without it ``/metrics`` is
404 and no route header is sent, like a server without them.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from disagg.bench.metrics import metrics_by_class
from disagg.bench.records import RequestRecord
from disagg.bench.runner import BenchResult, RunResult, Step
from disagg.bench.slo import SLO
from disagg.bench.workload import Workload, parse_classes
from disagg.proxy.metrics import CONTENT_TYPE, ProxyMetrics
from disagg.proxy.router import ROUTE_HEADER
from harness.ports import free_port


@dataclass
class StandIn:
    """The stand-in server's settings and what it saw."""

    url: str = ""
    model: str = "standin-model"
    base_ttft: float = 0.005
    prefill_tokens_per_s: float = 100_000.0
    tpot: float = 0.002
    #: added to ``tpot`` per prompt token (a decode step that reads the context's KV)
    tpot_per_prompt_token: float = 0.0
    tokenize: bool = True
    bodies: list[dict[str, Any]] = field(default_factory=list)
    #: the Authorization header of each generation request (None: absent)
    authorizations: list[str | None] = field(default_factory=list)
    #: statuses to refuse the next generation requests with (popped from the front)
    refuse: list[int] = field(default_factory=list)
    #: answer the next this many /tokenize calls 429 (Retry-After: 0), as a proxy at its cap
    busy_tokenize: int = 0
    routes: ProxyMetrics | None = None
    split_from: int = 100
    #: the ``reason`` its routes are counted with (``predicted``: an ``auto`` proxy; ``policy``: a static one)
    route_reason: str = "predicted"
    predict_factor: float = 1.5


def _count(text: str) -> int:
    return len(text) + 1                # characters + BOS


def _app(state: StandIn) -> web.Application:
    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": state.model, "root": "/models/x"}]})

    async def tokenize(request: web.Request) -> web.Response:
        if not state.tokenize:
            raise web.HTTPNotFound()
        if state.busy_tokenize > 0:
            state.busy_tokenize -= 1
            return web.json_response({"error": {"message": "busy"}}, status=429, headers={"Retry-After": "0"})
        body = await request.json()
        if "messages" in body:
            text = "".join(m["content"] for m in body["messages"])
            tokens = [1] + [ord(c) for c in text] + [2, 3]            # template adds 2 tokens
        else:
            text = body["prompt"]
            tokens = ([1] if body.get("add_special_tokens", True) else []) + [ord(c) for c in text]
        return web.json_response({"count": len(tokens), "max_model_len": 10_000, "tokens": tokens})

    async def detokenize(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"prompt": "".join(chr(t) for t in body["tokens"])})

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        state.bodies.append(body)
        state.authorizations.append(request.headers.get("Authorization"))
        chat = "messages" in body
        text = body["messages"][0]["content"] if chat else body["prompt"]
        if "FAIL" in text:
            return web.json_response({"error": {"message": "stand-in failure"}}, status=500)
        if state.refuse:
            status = state.refuse.pop(0)
            return web.json_response({"error": {"message": f"stand-in refusal {status}"}}, status=status)
        prompt_tokens = _count(text) + (2 if chat else 0)
        ttft = state.base_ttft + prompt_tokens / state.prefill_tokens_per_s
        headers = {"Content-Type": "text/event-stream"}
        if state.routes is not None:
            path = "local" if prompt_tokens < state.split_from else "split"
            headers[ROUTE_HEADER] = path
            state.routes.route.labels(path=path, reason=state.route_reason).inc()
            state.routes.route_predicted.labels(path=path).observe(state.predict_factor * ttft)
            state.routes.route_observed.labels(path=path).observe(ttft)
        n = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        resp = web.StreamResponse(headers=headers)
        await resp.prepare(request)
        await asyncio.sleep(ttft)
        for i in range(n):
            if i:
                await asyncio.sleep(state.tpot + state.tpot_per_prompt_token * prompt_tokens)
            choice = {"index": 0, "delta": {"content": "x"}} if chat else {"index": 0, "text": "x"}
            await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        if body.get("stream_options", {}).get("include_usage"):
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
            await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def metrics(_: web.Request) -> web.Response:
        if state.routes is None:
            raise web.HTTPNotFound()
        return web.Response(body=state.routes.render(), headers={"Content-Type": CONTENT_TYPE})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    return app


@pytest.fixture
async def standin_factory() -> AsyncIterator[Callable[[], Awaitable[StandIn]]]:
    """Start any number of stand-in OpenAI servers on free loopback ports; all stop at teardown."""
    runners: list[web.AppRunner] = []

    async def start() -> StandIn:
        state = StandIn()
        runner = web.AppRunner(_app(state))
        await runner.setup()
        runners.append(runner)
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        state.url = f"http://127.0.0.1:{port}"
        return state

    try:
        yield start
    finally:
        for runner in runners:
            await runner.cleanup()


@pytest.fixture
async def standin(standin_factory: Callable[[], Awaitable[StandIn]]) -> StandIn:
    """One running stand-in OpenAI server."""
    return await standin_factory()


def synthetic_result(label_seed: int, rates: tuple[float, ...] = (0.5, 1.0, 2.0),
                     slo: SLO | None = None) -> BenchResult:
    """A plausible sweep without a server: latencies grow with the rate."""
    slo = slo or SLO(ttft=0.3, tpot=0.05)
    workload = Workload(parse_classes("short=64,long=512", output_len=16), num_requests=40, seed=label_seed)
    runs = []
    for rate in rates:
        records = []
        for i in range(40):
            klass = "short" if i % 2 else "long"
            ttft = (0.05 if klass == "short" else 0.2) * (1 + rate * (i % 7) / 10) * (1 + label_seed / 5)
            gap = 0.02 * (1 + rate / 4) * (1 + (i % 5) / 10)
            send = i / rate
            first = send + ttft
            records.append(RequestRecord(i, klass, send=send, prompt_tokens=64 if klass == "short" else 512,
                                         output_tokens=16, chunk_times=[first + k * gap for k in range(16)]))
        duration = max(r.end or 0 for r in records)
        runs.append(RunResult(step=Step(rate=rate), started_at="2026-01-01T00:00:00+00:00", duration_s=duration,
                              records=records, metrics=metrics_by_class(records, duration, slo)))
    return BenchResult(base_url="http://stand-in", model="m", workload=workload, slo=slo, runs=runs)


@pytest.fixture
def synthetic() -> Callable[..., BenchResult]:
    """:func:`synthetic_result`, for tests that need results without a server."""
    return synthetic_result
