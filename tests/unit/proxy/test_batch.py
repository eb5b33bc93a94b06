"""Batched prompts through the proxy: one handoff per prompt, replies joined as vLLM joins them.

Stand-in engines (tests/unit/proxy/proxy_standin.py) record what the proxy
sent; the real-engine comparison with a single vLLM server is in
tests/e2e/test_conformance.py.
"""

from __future__ import annotations

import asyncio
import json
from typing import ClassVar

from proxy_standin import read_events, wait_for

from disagg.prometheus_text import sample_sum


async def test_batch_gets_one_prefill_and_one_decode_per_prompt(standin, proxy, http) -> None:
    p = await standin("P")
    d = await standin("D", tokens=2, prompt_text=True)
    server = await proxy(prefill=[p.url], decode=[d.url])
    body = {"model": "tiny", "prompt": ["a", "b", "c"], "max_tokens": 2}
    async with http.post(server.url + "/v1/completions", json=body, headers={"X-Request-Id": "rq"}) as resp:
        assert resp.status == 200
        assert resp.headers["X-Request-Id"] == "rq"
        reply = await resp.json()
    assert reply["id"] == "cmpl-rq"
    assert [(c["index"], c["text"]) for c in reply["choices"]] == [
        (0, "a:tok0 a:tok1 "), (1, "b:tok0 b:tok1 "), (2, "c:tok0 c:tok1 ")]
    assert reply["usage"] == {"prompt_tokens": 9, "completion_tokens": 6, "total_tokens": 15}
    pre = sorted(p.generations(), key=lambda r: r.body["prompt"])
    assert [(r.body["prompt"], r.headers["X-Request-Id"]) for r in pre] == [("a", "rq-0"), ("b", "rq-1"), ("c", "rq-2")]
    dec = sorted(d.generations(), key=lambda r: r.body["prompt"])
    assert [r.body["prompt"] for r in dec] == ["a", "b", "c"]
    # each decode gets its own prompt's kv_transfer_params (the stand-in names the request id in them)
    assert [r.body["kv_transfer_params"]["remote_request_id"] for r in dec] == ["cmpl-rq-0", "cmpl-rq-1", "cmpl-rq-2"]
    metrics = (await (await http.get(server.url + "/metrics")).read()).decode()
    assert sample_sum(metrics, "disagg_proxy_requests_total", path="split") == 1


async def test_batch_stream_is_reindexed_with_one_usage_chunk_and_one_done(standin, proxy, http) -> None:
    p = await standin("P")
    d = await standin("D", tokens=3, prompt_text=True, token_delay=0.01)
    server = await proxy(prefill=[p.url], decode=[d.url])
    body = {"model": "tiny", "prompt": ["a", "b"], "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}
    async with http.post(server.url + "/v1/completions", json=body, headers={"X-Request-Id": "s"}) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = await read_events(resp)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1] == {"id": "cmpl-s", "choices": [], "usage": {"completion_tokens": 6}}
    texts: dict[int, str] = {}
    for chunk in chunks[:-1]:
        assert chunk["id"] == "cmpl-s"
        [choice] = chunk["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {0: "a:tok0 a:tok1 a:tok2 ", 1: "b:tok0 b:tok1 b:tok2 "}
    assert all(r.body["stream"] is True for r in d.generations())


async def test_an_invalid_prompt_fails_the_whole_batch_before_streaming(standin, proxy, http) -> None:
    p = await standin("P", fail_on_prompt="bad")
    d = await standin("D", tokens=50, token_delay=0.05)
    server = await proxy(prefill=[p.url], decode=[d.url])
    body = {"model": "tiny", "prompt": ["good", "bad"], "max_tokens": 50, "stream": True}
    async with http.post(server.url + "/v1/completions", json=body) as resp:
        assert resp.status == 400
        error = await resp.json()
    assert error["error"]["type"] == "BadRequestError"
    await wait_for(lambda: d.running == 0)  # the good prompt's decode was closed, not left running


async def test_a_decode_dying_mid_stream_ends_the_batch_with_an_error_event(standin, proxy, http) -> None:
    p = await standin("P")
    d = await standin("D", tokens=6, die_after=2, token_delay=0.01)
    server = await proxy(prefill=[p.url], decode=[d.url])
    body = {"model": "tiny", "prompt": ["a", "b"], "max_tokens": 6, "stream": True}
    async with http.post(server.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        events = await read_events(resp)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    error = json.loads(events[-2])
    assert error["error"]["code"] == 502 and "decode stream broke" in error["error"]["message"]
    await wait_for(lambda: d.running == 0)


async def test_client_leaving_a_batch_aborts_every_route(standin, proxy, http) -> None:
    p = await standin("P")
    gate = asyncio.Event()
    d = await standin("D", tokens=5, gate=gate)
    server = await proxy(prefill=[p.url], decode=[d.url])
    body = {"model": "tiny", "prompt": ["a", "b", "c"], "max_tokens": 5, "stream": True}
    resp = await http.post(server.url + "/v1/completions", json=body)
    assert resp.status == 200
    await wait_for(lambda: d.running == 3)
    await resp.content.readline()
    resp.close()
    await wait_for(lambda: d.running == 0 and d.aborted == 3)


async def test_n_and_prompt_logprobs_are_served_by_decode_alone(standin, proxy, http) -> None:
    p = await standin("P")
    d = await standin("D", tokens=2)
    server = await proxy(prefill=[p.url], decode=[d.url])
    for extra in ({"n": 2}, {"prompt_logprobs": 1}, {"echo": True, "logprobs": 1}):
        body = {"model": "tiny", "prompt": ["a", "b"], "max_tokens": 2, **extra}
        async with http.post(server.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            await resp.read()
        assert d.generations()[-1].body == body, "sent whole, unchanged, without kv_transfer_params"
    assert p.generations() == []
    metrics = (await (await http.get(server.url + "/metrics")).read()).decode()
    assert sample_sum(metrics, "disagg_proxy_local_routes_total", reason="n") == 1
    assert sample_sum(metrics, "disagg_proxy_local_routes_total", reason="prompt_logprobs") == 2
    assert sample_sum(metrics, "disagg_proxy_requests_total", path="local") == 3


async def test_client_kv_transfer_params_never_reach_an_engine(standin, proxy, http) -> None:
    p = await standin("P")
    d = await standin("D", tokens=1)
    server = await proxy(prefill=[p.url], decode=[d.url])
    evil = {"do_remote_prefill": True, "remote_host": "198.18.0.1", "remote_port": "not-a-port"}
    for extra in ({}, {"n": 2}, {"prompt": ["a", "b"]}):
        body = {"model": "tiny", "prompt": "x", "max_tokens": 1, "kv_transfer_params": evil,
                "vllm_xargs": {"kv_transfer_params": "x"}, **extra}
        async with http.post(server.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
    async with http.post(server.url + "/v1/responses", json={"input": "x", "kv_transfer_params": evil}) as resp:
        assert resp.status == 200
    assert len(p.received) == 3 and len(d.received) == 5
    for engine in (p, d):
        for got in engine.received:
            params = got.body.get("kv_transfer_params")
            # only the proxy's own: prefill's request for KV, or what prefill answered
            assert params is None or params.get("do_remote_decode") is True \
                or params.get("remote_engine_id") == "engine-P", got
            assert "kv_transfer_params" not in (got.body.get("vllm_xargs") or {}), got


async def test_a_body_that_is_no_json_object_goes_to_decode_as_it_is(standin, proxy, http) -> None:
    """The single server's own error is the answer (vLLM parses with the same json module)."""
    p = await standin("P")
    d = await standin("D")
    server = await proxy(prefill=[p.url], decode=[d.url])
    nested = b'{"model": "tiny", "prompt": "x", "extra": ' + b"[" * 100000 + b"]" * 100000 + b"}"
    for raw in (nested, b"", b'{"model": ', b"[1, 2]"):
        async with http.post(server.url + "/v1/completions", data=raw,
                             headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["type"] == "Bad Request", "the engine's own answer"
    assert p.received == []
    assert len(d.received) == 4


async def test_options_is_answered_by_the_proxy(standin, proxy, http) -> None:
    d = await standin("D")
    server = await proxy(decode=[d.url], api_key="k")
    preflight = {"Origin": "http://example.test", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    async with http.options(server.url + "/v1/completions", headers=preflight, data=b'{"prompt": "x"}') as resp:
        assert resp.status == 200
        assert resp.headers["Access-Control-Allow-Origin"] == "*"
        assert "POST" in resp.headers["Access-Control-Allow-Methods"]
        assert resp.headers["Access-Control-Allow-Headers"] == "authorization,content-type"
    async with http.options(server.url + "/v1/models") as resp:
        assert resp.status == 405
    assert d.received == [], "OPTIONS never reaches an engine"


async def test_relay_counts_events_split_across_reads(http) -> None:
    """The relay counts token events whatever the read boundaries (here: 3 bytes per read)."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from disagg.proxy.config import ProxyTimeouts
    from disagg.proxy.relay import StreamTiming, relay_stream

    events = b"".join(b'data: {"choices":[{"index":0,"text":"t%d"}]}\n\n' % i for i in range(5))
    stream = events + b'data: {"choices":[],"usage":{}}\n\ndata: [DONE]\n\n'

    class Pieces:
        at = 0

        async def readany(self) -> bytes:
            piece = stream[self.at:self.at + 3]
            self.at += 3
            return piece

    class Resp:
        status = 200
        headers: ClassVar[dict[str, str]] = {}
        content = Pieces()

    class Client:
        timeouts = ProxyTimeouts()

    timing = StreamTiming(0.0)

    async def handler(request: web.Request) -> web.StreamResponse:
        return await relay_stream(request, Client(), None, Resp(), "rid", timing)  # type: ignore[arg-type]

    app = web.Application()
    app.router.add_get("/", handler)
    async with TestServer(app) as server, http.get(server.make_url("/")) as resp:
        assert await resp.read() == stream
    assert timing.token_events == 5


async def test_over_the_concurrency_cap_is_429_with_retry_after(standin, proxy, http) -> None:
    gate = asyncio.Event()
    d = await standin("D", tokens=2, gate=gate)
    server = await proxy(decode=[d.url], max_concurrency=2)
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2, "stream": True}
    held = [await http.post(server.url + "/v1/completions", json=body) for _ in range(2)]
    await wait_for(lambda: d.running == 2)
    async with http.post(server.url + "/v1/completions", json=body) as resp:
        assert resp.status == 429
        assert resp.headers["Retry-After"] == "1"
        assert (await resp.json())["error"]["type"] == "RateLimitError"
    async with http.get(server.url + "/health") as resp:
        assert resp.status == 200, "probes are never refused"
    gate.set()
    for resp in held:
        await resp.read()
        resp.close()
    async with http.post(server.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        await resp.read()
    metrics = (await (await http.get(server.url + "/metrics")).read()).decode()
    assert sample_sum(metrics, "disagg_proxy_rejected_total", reason="concurrency") == 1
    assert sample_sum(metrics, "disagg_proxy_active_requests") == 0
    assert len(d.generations()) == 3
