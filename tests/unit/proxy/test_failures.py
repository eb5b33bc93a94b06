"""Failure behaviour: prefill down or erroring (fallback / never), decode
failing after prefill, client disconnect. Stand-ins produce the faults."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from proxy_standin import read_events, wait_for

from harness.ports import free_port

BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 4}


def sample(server, name: str, labels: dict[str, str]) -> float:
    value = server.app_state.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


@pytest.mark.parametrize("fault", ["refused", "status500", "no_kv_params"])
async def test_prefill_failure_falls_back_to_decode_alone(fault, standin, proxy, http) -> None:
    d = await standin("D", tokens=2)
    if fault == "refused":
        prefill_url = f"http://127.0.0.1:{free_port()}"
        # the prefill is down from the start: the proxy's /health is 503, yet requests are served
    else:
        p = await standin("P", fail_status=500 if fault == "status500" else None,
                          no_kv_params=fault == "no_kv_params")
        prefill_url = p.url
    server = await proxy(prefill=[prefill_url], decode=[d.url])
    async with http.post(server.url + "/v1/completions", json=BODY) as resp:
        assert resp.status == 200
        reply = await resp.json()
    assert reply["choices"][0]["text"] == "tok0 tok1 "
    [dec] = d.generations()
    assert dec.body == BODY, "decode alone gets the client's request unchanged"
    assert sample(server, "disagg_proxy_requests_total", {"endpoint": "completions", "path": "fallback"}) == 1
    reason = {"refused": "no_healthy_prefill", "status500": "status", "no_kv_params": "no_kv_params"}[fault]
    assert sample(server, "disagg_proxy_fallbacks_total", {"reason": reason}) == 1


async def test_prefill_refusing_after_health_is_taken_out_and_falls_back(standin, proxy, http) -> None:
    p = await standin("P")
    d = await standin("D", tokens=1)
    server = await proxy(prefill=[p.url], decode=[d.url])
    await p.stop()  # dies between two probes
    async with http.post(server.url + "/v1/completions", json=BODY) as resp:
        assert resp.status == 200
    assert sample(server, "disagg_proxy_requests_total", {"endpoint": "completions", "path": "fallback"}) == 1
    await wait_for(lambda: not server.app_state.prefill.backends[0].healthy)
    async with http.get(server.url + "/health") as resp:
        assert resp.status == 503
        assert "no healthy prefill instance" in (await resp.json())["error"]["message"]


async def test_fallback_never_answers_503_with_openai_error(standin, proxy, http) -> None:
    p = await standin("P", fail_status=500)
    d = await standin("D")
    server = await proxy(prefill=[p.url], decode=[d.url], fallback="never")
    async with http.post(server.url + "/v1/completions", json={**BODY, "stream": True}) as resp:
        assert resp.status == 503
        err = (await resp.json())["error"]
    assert err["type"] == "ServiceUnavailableError" and err["code"] == 503
    assert p.url in err["message"] and "fallback is 'never'" in err["message"]
    assert d.generations() == []
    assert sample(server, "disagg_proxy_requests_total", {"endpoint": "completions", "path": "error"}) == 1


async def test_prefill_client_error_reaches_client_unchanged(standin, proxy, http) -> None:
    p = await standin("P", fail_status=400)
    d = await standin("D")
    server = await proxy(prefill=[p.url], decode=[d.url])
    async with http.post(server.url + "/v1/chat/completions",
                         json={"model": "tiny", "messages": []}) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"] == {"message": "P failed on purpose", "type": "StandInError",
                                                "param": None, "code": 400}
    assert d.generations() == []


async def test_decode_error_status_after_prefill_reaches_client(standin, proxy, http) -> None:
    p = await standin("P")
    d = await standin("D", fail_status=500)
    server = await proxy(prefill=[p.url], decode=[d.url])
    async with http.post(server.url + "/v1/completions", json={**BODY, "stream": True}) as resp:
        assert resp.status == 500
        assert (await resp.json())["error"]["message"] == "D failed on purpose"
    assert len(p.generations()) == 1
    assert sample(server, "disagg_proxy_requests_total", {"endpoint": "completions", "path": "error"}) == 1


async def test_decode_dying_mid_stream_ends_the_stream_with_an_error_event(standin, proxy, http) -> None:
    p = await standin("P")
    d = await standin("D", tokens=5, die_after=2)
    server = await proxy(prefill=[p.url], decode=[d.url])
    async with http.post(server.url + "/v1/completions", json={**BODY, "stream": True},
                         timeout=aiohttp.ClientTimeout(total=5)) as resp:
        assert resp.status == 200
        events = await read_events(resp)
    assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == ["tok0 ", "tok1 "]
    err = json.loads(events[2])["error"]
    assert err["code"] == 502 and d.url in err["message"]
    assert events[3:] == ["[DONE]"]
    assert sample(server, "disagg_proxy_requests_total", {"endpoint": "completions", "path": "error"}) == 1
    assert sample(server, "disagg_proxy_backend_in_flight", {"role": "decode", "url": d.url}) == 0


async def test_decode_down_after_prefill_is_a_clear_error(standin, proxy, http) -> None:
    p = await standin("P")
    d = await standin("D")
    server = await proxy(prefill=[p.url], decode=[d.url])
    await d.stop()
    async with http.post(server.url + "/v1/completions", json=BODY) as resp:
        assert resp.status == 503
        err = (await resp.json())["error"]
    assert "no healthy decode instance" in err["message"] and d.url in err["message"]


async def test_decode_hanging_times_out(standin, proxy, http) -> None:
    from disagg.proxy import ProxyTimeouts

    p = await standin("P")
    d = await standin("D", hang=True)
    server = await proxy(prefill=[p.url], decode=[d.url],
                         timeouts=ProxyTimeouts(connect=1, request=0.3, health_interval=0.1, health_timeout=1,
                                                drain=1))
    async with http.post(server.url + "/v1/completions", json=BODY) as resp:
        assert resp.status == 504
        err = (await resp.json())["error"]
    assert err["type"] == "GatewayTimeoutError" and "0.3s" in err["message"]
    await wait_for(lambda: d.running == 0 and d.aborted == 1)


@pytest.mark.parametrize("colocated", [False, True])
async def test_client_disconnect_mid_stream_aborts_decode(colocated, standin, proxy, http) -> None:
    gate = asyncio.Event()
    d = await standin("D", tokens=50, gate=gate)
    prefill = [] if colocated else [(await standin("P")).url]
    server = await proxy(prefill=prefill, decode=[d.url])
    resp = await http.post(server.url + "/v1/chat/completions",
                           json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True})
    first = await resp.content.readline()
    assert first.startswith(b"data: ")
    assert d.running == 1
    resp.close()  # the client goes away mid-stream; the stand-in is still waiting at its gate
    await wait_for(lambda: d.running == 0)
    assert d.aborted == 1, "the decode request was aborted, not finished"
    await wait_for(lambda: sample(server, "disagg_proxy_backend_in_flight", {"role": "decode", "url": d.url}) == 0)
    for url in prefill:
        assert sample(server, "disagg_proxy_backend_in_flight", {"role": "prefill", "url": url}) == 0
    gate.set()


async def test_prefill_timeout_falls_back(standin, proxy, http) -> None:
    from disagg.proxy import ProxyTimeouts

    p = await standin("P", hang=True)
    d = await standin("D", tokens=1)
    server = await proxy(prefill=[p.url], decode=[d.url],
                         timeouts=ProxyTimeouts(connect=1, request=0.3, health_interval=0.1, health_timeout=1,
                                                drain=1))
    async with http.post(server.url + "/v1/completions", json=BODY) as resp:
        assert resp.status == 200
    assert sample(server, "disagg_proxy_fallbacks_total", {"reason": "timeout"}) == 1
    await wait_for(lambda: p.running == 0 and p.aborted == 1)  # the prefill request was closed, not left running


async def test_client_disconnect_during_prefill_releases_prefill(standin, proxy, http) -> None:
    p = await standin("P", hang=True)
    d = await standin("D")
    server = await proxy(prefill=[p.url], decode=[d.url])
    task = asyncio.create_task(http.post(server.url + "/v1/completions", json=BODY))
    await wait_for(lambda: p.running == 1)
    task.cancel()  # the client gives up while prefill is still computing
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_for(lambda: p.running == 0)
    assert p.aborted == 1 and d.generations() == []
    await wait_for(lambda: sample(server, "disagg_proxy_backend_in_flight", {"role": "prefill", "url": p.url}) == 0)
