"""The SGLang handoff against stand-in SGLang servers (sglang_standin.py) that
follow SGLang's bootstrap semantics; real SGLang P/D needs a GPU
(benchmarks/gpu/verify.sh)."""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from proxy_standin import read_events, wait_for
from sglang_standin import SglangStandIn

from disagg.errors import ProxyError
from disagg.proxy import ProxyServer
from disagg.proxy.handoff import handoff_class
from disagg.proxy.sglang_handoff import (
    SglangHandoff,
    bootstrap_body,
    bootstrap_ports,
    merge_input_logprobs,
)

#: no test may take longer than this (nothing hangs)
LIMIT_S = 8.0


@pytest.fixture
def sglang(started: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[SglangStandIn]]:
    """Factory of started stand-in SGLang servers, stopped after the test."""
    return functools.partial(started, SglangStandIn)


async def _pair(sglang: Any, proxy: Any, p_kw: dict[str, Any] | None = None,
                d_kw: dict[str, Any] | None = None) -> tuple[SglangStandIn, SglangStandIn, ProxyServer]:
    p = await sglang("prefill", **(p_kw or {}))
    d = await sglang("decode", **(d_kw or {}))
    server = await proxy(prefill=[p.url], decode=[d.url], handoff="sglang",
                         handoff_options=(("bootstrap_ports", str(p.bootstrap_port)),))
    return p, d, server


def test_registered_for_engine_sglang() -> None:
    assert handoff_class("sglang") is SglangHandoff


def test_bootstrap_ports_one_per_url_or_one_for_all() -> None:
    assert bootstrap_ports(("http://a:1", "http://b:1"), "8998,8999") == {"http://a:1": 8998, "http://b:1": 8999}
    assert bootstrap_ports(("http://a:1", "http://b:1"), "7000") == {"http://a:1": 7000, "http://b:1": 7000}
    for bad in (None, "", "x", "1,2,3", "70000"):
        with pytest.raises(ProxyError):
            bootstrap_ports(("http://a:1", "http://b:1"), bad)


def test_bootstrap_body_adds_fields_and_batches_get_rooms() -> None:
    body = {"prompt": "hi", "max_tokens": 3}
    out = bootstrap_body(body, "10.0.0.1", 8998, 42)
    assert out == {**body, "bootstrap_host": "10.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 42}
    batch = bootstrap_body({"text": ["a", "b", "c"]}, "h", 1, 5)
    assert batch["bootstrap_host"] == ["h"] * 3 and batch["bootstrap_port"] == [1] * 3
    assert batch["bootstrap_room"][0] == 5 and len(set(batch["bootstrap_room"])) == 3


def test_merge_input_logprobs_puts_prefill_first() -> None:
    merged = merge_input_logprobs({"meta_info": {"input_token_logprobs": [[-1, 1]]}},
                                  {"meta_info": {"input_token_logprobs": [[None, 2]]}, "x": 1})
    assert merged == {"meta_info": {"input_token_logprobs": [[-1, 1], [None, 2]]}, "x": 1}


async def test_missing_bootstrap_ports_fails_at_start(sglang, proxy) -> None:
    p, d = await sglang("prefill"), await sglang("decode")
    with pytest.raises(ProxyError, match="bootstrap_ports"):
        await proxy(prefill=[p.url], decode=[d.url], handoff="sglang")


async def test_stream_same_room_on_both_sides_and_decode_reaches_client(sglang, proxy, http) -> None:
    p, d, server = await _pair(sglang, proxy)
    body = {"model": "m", "prompt": "hello", "max_tokens": 3, "stream": True}
    async with asyncio.timeout(LIMIT_S):
        async with http.post(server.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            events = await read_events(resp)
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == ["tok0", "tok1", "tok2"]
    assert events[-1] == "[DONE]"
    (pb,), (db,) = p.received, d.received
    assert pb == db                                         # the same body, sent to both
    assert pb["bootstrap_room"] == db["bootstrap_room"] and 0 <= pb["bootstrap_room"] < 2 ** 63
    assert (pb["bootstrap_host"], pb["bootstrap_port"]) == ("127.0.0.1", p.bootstrap_port)
    assert {k: v for k, v in pb.items() if not k.startswith("bootstrap_")} == body
    assert p.aborted == d.aborted == 0


async def test_rooms_differ_between_requests(sglang, proxy, http) -> None:
    p, _d, server = await _pair(sglang, proxy)
    async with asyncio.timeout(LIMIT_S):
        for _ in range(2):
            async with http.post(server.url + "/v1/chat/completions",
                                 json={"messages": [{"role": "user", "content": "x"}]}) as resp:
                assert resp.status == 200
                assert (await resp.json())["served_by"] == "decode"
    assert len({b["bootstrap_room"] for b in p.received}) == 2


async def test_prefill_failure_aborts_decode(sglang, proxy, http) -> None:
    _p, d, server = await _pair(sglang, proxy, p_kw={"fail_status": 500})
    async with asyncio.timeout(LIMIT_S):
        async with http.post(server.url + "/v1/completions", json={"prompt": "x", "stream": True}) as resp:
            assert resp.status == 502
            assert "prefill answered 500" in (await resp.json())["error"]["message"]
        await wait_for(lambda: d.aborted == 1 and d.running == 0)


async def test_prefill_client_error_reaches_client_and_aborts_decode(sglang, proxy, http) -> None:
    _p, d, server = await _pair(sglang, proxy, p_kw={"fail_status": 400})
    async with asyncio.timeout(LIMIT_S):
        async with http.post(server.url + "/v1/completions", json={"prompt": "x"}) as resp:
            assert resp.status == 400
            assert "failed on purpose" in (await resp.json())["message"]
        await wait_for(lambda: d.aborted == 1 and d.running == 0)


async def test_decode_failure_aborts_prefill(sglang, proxy, http) -> None:
    p, _d, server = await _pair(sglang, proxy, d_kw={"fail_status": 500, "fail_delay": 0.2})
    async with asyncio.timeout(LIMIT_S):
        async with http.post(server.url + "/v1/completions", json={"prompt": "x", "stream": True}) as resp:
            assert resp.status == 500                        # decode's own error, relayed
        # prefill waited for a decode registration that never came: the proxy closed it
        await wait_for(lambda: p.aborted == 1 and p.running == 0)


async def test_prefill_failure_after_decode_started_breaks_the_stream(sglang, proxy, http) -> None:
    _p, d, server = await _pair(sglang, proxy, p_kw={"fail_status": 500, "fail_delay": 0.3},
                               d_kw={"early_headers": True})
    async with asyncio.timeout(LIMIT_S):
        async with http.post(server.url + "/v1/completions", json={"prompt": "x", "stream": True}) as resp:
            assert resp.status == 200
            events = await read_events(resp)
        assert "decode stream broke" in events[0] and events[-1] == "[DONE]"
        await wait_for(lambda: d.aborted == 1 and d.running == 0)


async def test_no_healthy_prefill_is_503_not_decode_alone(sglang, proxy, http) -> None:
    p, d, server = await _pair(sglang, proxy)
    await p.stop()
    async with asyncio.timeout(LIMIT_S):
        pool = server.app_state.prefill
        assert pool is not None
        await wait_for(lambda: not pool.healthy())
        async with http.post(server.url + "/v1/completions", json={"prompt": "x"}) as resp:
            assert resp.status == 503
    assert d.received == []


async def test_prompt_logprobs_merged_whole_and_streamed(sglang, proxy, http) -> None:
    _p, _d, server = await _pair(sglang, proxy)
    async with asyncio.timeout(LIMIT_S):
        async with http.post(server.url + "/v1/completions",
                             json={"prompt": "x", "return_logprob": True}) as resp:
            assert resp.status == 200
            whole = await resp.json()
        async with http.post(server.url + "/v1/completions",
                             json={"prompt": "x", "return_logprob": True, "stream": True}) as resp:
            events = await read_events(resp)
    expected = [[-1.0, 11], [-2.0, 12], [None, 13]]
    assert whole["meta_info"]["input_token_logprobs"] == expected
    assert all(json.loads(e)["meta_info"]["input_token_logprobs"] == expected for e in events[:-1])
    assert len(events) == 4 and events[-1] == "[DONE]"


def test_handoff_options_cli_round_trip() -> None:
    from disagg.cli import build_parser
    from disagg.proxy import ProxyConfig
    from disagg.proxy.config import parse_handoff_options

    config = ProxyConfig(decode=("http://d:1",), prefill=("http://p:1",), handoff="sglang",
                         handoff_options=(("bootstrap_ports", "8998"),))
    assert config.to_argv()[-2:] == ["--handoff-option", "bootstrap_ports=8998"]
    assert ProxyConfig.from_args(build_parser().parse_args(config.to_argv())).handoff_options == \
        (("bootstrap_ports", "8998"),)
    for bad in (["novalue"], ["=1"]):
        with pytest.raises(ProxyError, match="KEY=VALUE"):
            parse_handoff_options(bad)
    with pytest.raises(ProxyError, match="distinct"):
        ProxyConfig(decode=("http://d:1",), handoff_options=(("a", "1"), ("a", "2")))


async def test_batch_gets_one_room_per_prompt_and_n_stays_on_the_handoff(sglang, proxy, http) -> None:
    """A list prompt becomes one bootstrap room per prompt (each prompt's own KV); SGLang decode
    servers cannot serve alone, so n > 1 still goes through the handoff, whole."""
    p, d, server = await _pair(sglang, proxy)
    async with asyncio.timeout(LIMIT_S):
        async with http.post(server.url + "/v1/completions",
                             json={"model": "m", "prompt": ["a", "b"], "max_tokens": 2}) as resp:
            assert resp.status == 200
            reply = await resp.json()
        assert [c["index"] for c in reply["choices"]] == [0, 1]
        assert sorted(b["prompt"] for b in p.received) == ["a", "b"]
        assert sorted(b["prompt"] for b in d.received) == ["a", "b"]
        assert len({b["bootstrap_room"] for b in d.received}) == 2
        async with http.post(server.url + "/v1/completions",
                             json={"model": "m", "prompt": "c", "max_tokens": 2, "n": 2}) as resp:
            assert resp.status == 200
            await resp.read()
    assert p.received[-1]["prompt"] == "c" and d.received[-1]["n"] == 2
    assert p.aborted == d.aborted == 0
