"""The vLLM handoff: exact prefill and decode bodies, over stand-in engines."""

from __future__ import annotations

import json

from proxy_standin import read_events

from disagg.proxy.handoff import CHAT, COMPLETIONS, HANDOFFS, VllmHandoff, handoff_class

PREFILL_KV = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None}


def test_prefill_body_chat_computes_one_token_unstreamed() -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "stream_options": {"include_usage": True}, "max_tokens": 50, "max_completion_tokens": 50,
            "min_tokens": 5, "n": 3, "stop": ["x"], "logprobs": True, "top_logprobs": 2, "temperature": 0}
    out = VllmHandoff.prefill_body(CHAT, body)
    assert out == {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": False,
                   "max_tokens": 1, "max_completion_tokens": 1, "n": 1, "stop": ["x"], "logprobs": True,
                   "top_logprobs": 2, "temperature": 0, "kv_transfer_params": PREFILL_KV}
    assert body["stream"] is True and body["max_tokens"] == 50, "the client's body must not change"


def test_prefill_body_completions_has_no_max_completion_tokens() -> None:
    out = VllmHandoff.prefill_body(COMPLETIONS, {"model": "tiny", "prompt": "p", "max_tokens": 9})
    assert out == {"model": "tiny", "prompt": "p", "stream": False, "max_tokens": 1,
                   "kv_transfer_params": PREFILL_KV}


def test_decode_body_is_client_body_plus_prefill_params() -> None:
    body = {"model": "tiny", "prompt": "p", "stream": True, "max_tokens": 9, "n": 2}
    params = {"do_remote_prefill": True, "remote_block_ids": [1]}
    assert VllmHandoff.decode_body(body, params) == {**body, "kv_transfer_params": params}


def test_every_registered_handoff_loads() -> None:
    for engine in HANDOFFS:
        assert handoff_class(engine).kind == engine


async def test_disaggregated_stream_sends_exact_bodies(standin, proxy, http) -> None:
    p = await standin("P")
    d = await standin("D", tokens=3)
    server = await proxy(prefill=[p.url], decode=[d.url])
    client_body = {"model": "tiny", "prompt": "hello", "max_tokens": 3, "stream": True,
                   "stream_options": {"include_usage": True}, "n": 1, "stop": ["\n"], "logprobs": 2,
                   "min_tokens": 2}
    async with http.post(server.url + "/v1/completions", json=client_body,
                         headers={"X-Request-Id": "req-42"}) as resp:
        assert resp.status == 200
        assert resp.headers["X-Request-Id"] == "req-42"
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = await read_events(resp)
    [pre] = p.generations()
    assert pre.path == "/v1/completions"
    assert pre.body == VllmHandoff.prefill_body(COMPLETIONS, client_body)
    assert pre.body["kv_transfer_params"] == PREFILL_KV
    assert "stream_options" not in pre.body and "min_tokens" not in pre.body
    [dec] = d.generations()
    assert dec.body == {**client_body, "kv_transfer_params": {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [7, 8],
        "remote_engine_id": "engine-P", "remote_request_id": "cmpl-req-42", "remote_host": "127.0.0.1",
        "remote_port": 5601, "tp_size": 1}}
    assert pre.headers["X-Request-Id"] == dec.headers["X-Request-Id"] == "req-42"
    assert [json.loads(e)["choices"][0]["text"] for e in events[:3]] == ["tok0 ", "tok1 ", "tok2 "]
    assert json.loads(events[3])["usage"] == {"completion_tokens": 3}
    assert events[-1] == "[DONE]"


async def test_disaggregated_chat_non_stream(standin, proxy, http) -> None:
    p = await standin("P")
    d = await standin("D", tokens=2)
    server = await proxy(prefill=[p.url], decode=[d.url])
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2,
            "n": 1, "logprobs": True, "top_logprobs": 1}
    async with http.post(server.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        reply = await resp.json()
        rid = resp.headers["X-Request-Id"]
    assert len(rid) == 32, "the proxy generates an X-Request-Id when the client sends none"
    assert [c["message"]["content"] for c in reply["choices"]] == ["tok0 tok1 "]
    [pre] = p.generations()
    assert pre.body["max_tokens"] == 1 and pre.body["max_completion_tokens"] == 1 and pre.body["n"] == 1
    assert pre.body["stream"] is False
    [dec] = d.generations()
    assert {k: v for k, v in dec.body.items() if k != "kv_transfer_params"} == body
    assert dec.body["kv_transfer_params"]["remote_engine_id"] == "engine-P"
    assert pre.headers["X-Request-Id"] == dec.headers["X-Request-Id"] == rid
