"""Routes, streaming pass-through, request ids, API key, error bodies, /metrics."""

from __future__ import annotations

import asyncio
import json

import pytest
from proxy_standin import read_events, wait_for

from disagg.proxy.metrics import LATENCY_BUCKETS


def openai_error(body: dict, code: int) -> dict:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code and isinstance(err["message"], str) and err["message"]
    return err


@pytest.mark.parametrize("colocated", [False, True])
async def test_stream_events_pass_through_as_they_arrive(colocated, standin, proxy, http) -> None:
    gate = asyncio.Event()
    d = await standin("D", tokens=3, gate=gate)
    prefill = [] if colocated else [(await standin("P")).url]
    server = await proxy(prefill=prefill, decode=[d.url])
    async with http.post(server.url + "/v1/completions",
                         json={"model": "tiny", "prompt": "x", "stream": True}) as resp:
        # the stand-in holds the rest of the stream until the client has the first event
        first = await asyncio.wait_for(resp.content.readline(), 2)
        assert json.loads(first.decode()[5:])["choices"][0]["text"] == "tok0 "
        gate.set()
        rest = await read_events(resp)
    assert [json.loads(e)["choices"][0]["text"] for e in rest[:-1]] == ["tok1 ", "tok2 "]
    assert rest[-1] == "[DONE]"
    path = "colocated" if colocated else "split"
    registry = server.app_state.metrics.registry
    assert registry.get_sample_value("disagg_proxy_requests_total", {"endpoint": "completions", "path": path}) == 1
    assert registry.get_sample_value("disagg_proxy_ttft_seconds_count") == 1
    assert registry.get_sample_value("disagg_proxy_tpot_seconds_count") == 1
    handoffs = registry.get_sample_value("disagg_proxy_handoff_seconds_count")
    assert handoffs == (0 if colocated else 1)


async def test_colocated_forwards_client_bytes_unchanged(standin, proxy, http) -> None:
    d = await standin("D")
    server = await proxy(decode=[d.url])
    raw = b'{"model":"tiny","prompt":"x","n":2,"stop":["a","b"],"logprobs":3,"max_tokens":2}'
    async with http.post(server.url + "/v1/completions", data=raw,
                         headers={"Content-Type": "application/json", "X-Request-Id": "abc"}) as resp:
        assert resp.status == 200
        assert resp.headers["X-Request-Id"] == "abc"
        assert len((await resp.json())["choices"]) == 2
    [got] = d.generations()
    assert got.body == json.loads(raw) and got.headers["X-Request-Id"] == "abc"


async def test_other_routes_go_to_decode(standin, proxy, http) -> None:
    p = await standin("P")
    d = await standin("D")
    server = await proxy(prefill=[p.url], decode=[d.url])
    async with http.get(server.url + "/v1/models") as resp:
        assert resp.status == 200
        assert (await resp.json())["data"][0]["owned_by"] == "D"
    async with http.get(server.url + "/version") as resp:
        assert (await resp.json()) == {"version": "0.32.0-standin"}
    async with http.post(server.url + "/tokenize", json={"prompt": "hi"}) as resp:
        assert (await resp.json())["echo"] == {"prompt": "hi"}
    async with http.post(server.url + "/detokenize", json={"tokens": [1, 2]}) as resp:
        assert (await resp.json())["echo"] == {"tokens": [1, 2]}
    async with http.post(server.url + "/v1/messages/count_tokens?x=1", json={"input": "hi"}) as resp:
        reply = await resp.json()
        assert reply == {"echo": {"input": "hi"}, "path": "/v1/messages/count_tokens?x=1", "server": "D"}
        assert resp.headers["X-Stand-In"] == "D"
    assert p.received == []


async def test_health_needs_a_healthy_prefill_and_decode(standin, proxy, http) -> None:
    p = await standin("P")
    d = await standin("D")
    server = await proxy(prefill=[p.url], decode=[d.url])
    async with http.get(server.url + "/health") as resp:
        assert resp.status == 200
    prefill = server.app_state.prefill.backends[0]
    p.health_status = 503
    await wait_for(lambda: not prefill.healthy)    # its next probe (every 0.1 s; later on a busy machine)
    async with http.get(server.url + "/health") as resp:
        assert resp.status == 503
        err = openai_error(await resp.json(), 503)
    assert "no healthy prefill instance" in err["message"] and p.url in err["message"]
    p.health_status = 200
    await wait_for(lambda: prefill.healthy)
    async with http.get(server.url + "/health") as resp:
        assert resp.status == 200


async def test_health_colocated_needs_one_server(standin, proxy, http) -> None:
    a = await standin("A")
    b = await standin("B", health_status=500)
    server = await proxy(decode=[a.url, b.url])
    async with http.get(server.url + "/health") as resp:
        assert resp.status == 200
        assert (await resp.json())["decode"] == {a.url: "healthy", b.url: "GET /health answered 500"}
    a.health_status = 500
    await wait_for(lambda: not server.app_state.decode.backends[0].healthy)
    async with http.get(server.url + "/health") as resp:
        assert resp.status == 503


async def test_api_key(standin, proxy, http) -> None:
    d = await standin("D")
    server = await proxy(decode=[d.url], api_key="sekret")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic sekret"}):
        async with http.post(server.url + "/v1/completions", json={"prompt": "x"}, headers=headers) as resp:
            assert resp.status == 401
            assert openai_error(await resp.json(), 401)["type"] == "AuthenticationError"
    async with http.get(server.url + "/v1/models") as resp:
        assert resp.status == 401
    async with http.post(server.url + "/v1/completions", json={"prompt": "x"},
                         headers={"Authorization": "Bearer sekret"}) as resp:
        assert resp.status == 200
    for open_path in ("/health", "/metrics"):
        async with http.get(server.url + open_path) as resp:
            assert resp.status == 200
    assert len(d.generations()) == 1


async def test_proxy_errors_use_openai_body(standin, proxy, http) -> None:
    d = await standin("D")
    server = await proxy(decode=[d.url])
    # a body that is no JSON object: the engine's own error, as from a single server
    async with http.post(server.url + "/v1/completions", data=b"{not json",
                         headers={"X-Request-Id": "bad-1"}) as resp:
        assert resp.status == 400
        assert resp.headers["X-Request-Id"] == "bad-1"
        assert openai_error(await resp.json(), 400)["type"] == "Bad Request"
    async with http.post(server.url + "/v1/completions", json=[1, 2]) as resp:
        assert resp.status == 400
    async with http.get(server.url + "/nope") as resp:
        assert resp.status == 404
        assert openai_error(await resp.json(), 404)["type"] == "NotFoundError"
    async with http.post(server.url + "/health") as resp:
        assert resp.status == 405
        openai_error(await resp.json(), 405)


async def test_metrics_exposition(standin, proxy, http) -> None:
    p = await standin("P")
    d = await standin("D")
    server = await proxy(prefill=[p.url], decode=[d.url])
    async with http.post(server.url + "/v1/completions", json={"prompt": "x"}) as resp:
        assert resp.status == 200
    async with http.get(server.url + "/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    assert 'disagg_proxy_requests_total{endpoint="completions",path="split"} 1.0' in text
    assert "disagg_proxy_prefill_seconds_count 1.0" in text
    assert f'disagg_proxy_backend_in_flight{{role="decode",url="{d.url}"}} 0.0' in text
    assert f'disagg_proxy_backend_healthy{{role="prefill",url="{p.url}"}} 1.0' in text
    assert 'disagg_proxy_ttft_seconds_bucket{le="2.0"}' in text


def test_latency_buckets_can_read_a_2s_slo() -> None:
    assert {1.0, 1.5, 2.0, 2.5, 3.0} <= set(LATENCY_BUCKETS)
    assert LATENCY_BUCKETS[0] <= 0.025 and list(LATENCY_BUCKETS) == sorted(LATENCY_BUCKETS)


async def test_two_proxies_keep_separate_metrics(standin, proxy, http) -> None:
    d = await standin("D")
    one = await proxy(decode=[d.url])
    two = await proxy(decode=[d.url])
    async with http.post(one.url + "/v1/completions", json={"prompt": "x"}):
        pass
    key = ("disagg_proxy_requests_total", {"endpoint": "completions", "path": "colocated"})
    assert one.app_state.metrics.registry.get_sample_value(*key) == 1
    assert two.app_state.metrics.registry.get_sample_value(*key) is None

