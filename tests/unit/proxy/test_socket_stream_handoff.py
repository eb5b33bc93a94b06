"""The streaming socket handoff (``--handoff vllm-socket-stream``) against stand-ins that keep
the protocol's shape (socket_stream_standin.py): prefill and decode get their requests at
once, joined by a fresh key; decode fetches from the chosen prefill's KV listener."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import string
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from proxy_standin import FAST, both_closed, healthy_pools, read_events, sample, wait_for
from socket_stream_standin import PEER_WAIT_S, StreamStandIn

from disagg.errors import ProxyError
from disagg.proxy import ProxyServer, ProxyTimeouts
from disagg.proxy.handoff import COMPLETIONS, VllmHandoff, handoff_class
from disagg.proxy.routes import GenerationRequest, PromptRoute, RoutePath
from disagg.proxy.socket_stream_handoff import (
    KV_PEERS,
    STREAM_KEY,
    KvPeer,
    SocketStreamHandoff,
    new_stream_key,
    parse_kv_peers,
)
from disagg.proxy.upstream import Upstream, make_session
from harness.ports import free_port
from tests.unit.proxy.learner import PrefillAnswers

#: no test may take longer than this (nothing hangs)
LIMIT_S = 8.0
BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 3}
#: health probes that do not run during the test (a backend stays as the request finds it)
NO_PROBES = ProxyTimeouts(connect=1.0, request=5.0, health_interval=60.0, health_timeout=1.0, drain=1.0)


@pytest.fixture
def streams(started: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[StreamStandIn]]:
    """Factory of started stand-ins, stopped after the test."""
    return functools.partial(started, StreamStandIn)


def peers_option(*prefills: StreamStandIn) -> tuple[tuple[str, str], ...]:
    return ((KV_PEERS, ",".join(f"127.0.0.1:{p.kv_port}" for p in prefills)),)


async def _pair(streams: Any, proxy: Any, p_kw: dict[str, Any] | None = None, d_kw: dict[str, Any] | None = None,
                **proxy_kw: Any) -> tuple[StreamStandIn, StreamStandIn, ProxyServer]:
    p = await streams("prefill", **(p_kw or {}))
    d = await streams("decode", **(d_kw or {}))
    server = await proxy(prefill=[p.url], decode=[d.url], handoff="vllm-socket-stream",
                         handoff_options=peers_option(p), **proxy_kw)
    return p, d, server


def decode_params(key: str, port: int) -> dict[str, Any]:
    return {"do_remote_prefill": True, "do_remote_decode": False, "transfer": "socket", "stream_key": key,
            "remote_host": "127.0.0.1", "remote_port": port}


# the option, the key, the registry


def test_registered_for_vllm_socket_stream() -> None:
    assert handoff_class("vllm-socket-stream") is SocketStreamHandoff
    assert SocketStreamHandoff.kind == "vllm-socket-stream" and SocketStreamHandoff.serves_local


def test_stream_keys_are_fresh_and_url_safe() -> None:
    keys = {new_stream_key() for _ in range(100)}
    assert len(keys) == 100
    allowed = set(string.ascii_letters + string.digits + "-_")
    assert all(len(k) == 32 and set(k) <= allowed for k in keys)
    assert STREAM_KEY == "stream_key"


def test_kv_peers_one_per_prefill_url_in_order() -> None:
    urls = ("http://a:8100", "http://b:8100", "http://c:8100")
    assert parse_kv_peers(urls, "10.0.0.1:5601,[fe80::1]:5602,p-host.lan:5603") == {
        "http://a:8100": KvPeer("10.0.0.1", 5601), "http://b:8100": KvPeer("fe80::1", 5602),
        "http://c:8100": KvPeer("p-host.lan", 5603)}


@pytest.mark.parametrize(("option", "message"), [
    (None, "needs the prefill instances' KV listeners"),
    ("", "needs the prefill instances' KV listeners"),
    ("10.0.0.1:5601", "1 entries for 2 prefill URLs"),              # one for all: not here
    ("h:1,h:2,h:3", "3 entries for 2 prefill URLs"),
    ("h:1,h:1", "names h:1 twice"),
    ("h:1,", "entry '': expected HOST:PORT"),
    ("h,h:2", "expected HOST:PORT"),
    ("h:,h:2", "port number"),
    (":1,h:2", "host name or IPv4"),
    ("h:0,h:2", "port number"),
    ("h:70000,h:2", "port number"),
    ("h:x,h:2", "port number"),
    ("h:+1,h:2", "port number"),
    ("h:\u0661,h:2", "port number"),                              # a non-ASCII digit
    ("h :1,h:2", "host name or IPv4"),
    ("user@h:1,h:2", "host name or IPv4"),
    ("fe80::1:5601,h:2", "brackets"),
    ("[fe80::1]5601,h:2", "expected HOST:PORT or [IPV6]:PORT"),
    ("[fe80::1],h:2", "expected HOST:PORT or [IPV6]:PORT"),
    ("[fe80::1]:,h:2", "port number"),
    ("[zz]:1,h:2", "not an IPv6 address"),
    ("[10.0.0.1]:1,h:2", "not an IPv6 address"),
])
def test_kv_peers_errors(option: str | None, message: str) -> None:
    with pytest.raises(ProxyError, match="kv_peers") as err:
        parse_kv_peers(("http://a:1", "http://b:1"), option)
    assert message in str(err.value)


async def test_missing_kv_peers_fails_at_start(streams, proxy) -> None:
    p, d = await streams("prefill"), await streams("decode")
    with pytest.raises(ProxyError, match="kv_peers"):
        await proxy(prefill=[p.url], decode=[d.url], handoff="vllm-socket-stream")


# the protocol


async def test_both_sides_at_once_with_one_key_and_the_chosen_prefills_listener(streams, proxy, http) -> None:
    p, d, server = await _pair(streams, proxy)
    body = {**BODY, "stream": True, "stream_options": {"include_usage": True}, "min_tokens": 1}
    async with asyncio.timeout(LIMIT_S):
        async with http.post(server.url + "/v1/completions", json=body, headers={"X-Request-Id": "r1"}) as resp:
            assert resp.status == 200
            events = await read_events(resp)
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == ["tok0 ", "tok1 ", "tok2 "]
    assert events[-1] == "[DONE]"
    (pb,), (db,) = p.received, d.received
    key = pb["kv_transfer_params"][STREAM_KEY]
    assert len(key) == 32
    assert pb == VllmHandoff.prefill_body(COMPLETIONS, body, {"do_remote_decode": True, "do_remote_prefill": False,
                                                               "stream_key": key})
    assert db == {**body, "kv_transfer_params": decode_params(key, p.kv_port)}
    # concurrent: decode had its request before prefill answered (prefill waits for decode's connection)
    assert d.arrived[0] < p.answered[0]
    assert d.recomputed == 0 and p.aborted == d.aborted == 0
    assert sample(server, "disagg_proxy_requests_total", {"endpoint": "completions", "path": "split"}) == 1
    assert sample(server, "disagg_proxy_prefill_seconds_count") == 1
    for role, url in (("prefill", p.url), ("decode", d.url)):
        assert sample(server, "disagg_proxy_backend_in_flight", {"role": role, "url": url}) == 0


async def test_fresh_key_per_route_and_the_peer_of_the_prefill_that_got_it(streams, proxy, http) -> None:
    p1, p2 = await streams("prefill"), await streams("prefill")
    d = await streams("decode")
    server = await proxy(prefill=[p1.url, p2.url], decode=[d.url], handoff="vllm-socket-stream",
                         handoff_options=peers_option(p1, p2))
    async with asyncio.timeout(LIMIT_S):
        for _ in range(3):
            async with http.post(server.url + "/v1/chat/completions",
                                 json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]}) as resp:
                assert resp.status == 200
                assert (await resp.json())["served_by"] == "decode"
        async with http.post(server.url + "/v1/completions", json={**BODY, "prompt": ["a", "b"]}) as resp:
            assert resp.status == 200
            assert [c["index"] for c in (await resp.json())["choices"]] == [0, 1]
    port_of = {b["kv_transfer_params"][STREAM_KEY]: p.kv_port for p in (p1, p2) for b in p.received}
    keys = [b["kv_transfer_params"][STREAM_KEY] for b in d.received]
    assert len(keys) == len(set(keys)) == len(port_of) == 5
    for b in d.received:
        params = b["kv_transfer_params"]
        assert params == decode_params(params[STREAM_KEY], port_of[params[STREAM_KEY]])
    assert p1.received and p2.received                   # both prefill instances were used
    assert sorted(b["prompt"] for b in d.received if "prompt" in b) == ["a", "b"]


async def test_serve_records_engines_and_params_and_tells_the_learner(streams) -> None:
    """Direct use: the routing policy's presets are used while healthy; the route records
    the engines and decode's kv_transfer_params; the route's learner gets prefill's time and count."""
    p1, p2, d = await streams("prefill"), await streams("prefill"), await streams("decode")
    metrics, prefill, decode = healthy_pools([p1.url, p2.url], [d.url])
    answers = PrefillAnswers()
    seen = answers.seen
    async with make_session(FAST) as session:
        handoff = SocketStreamHandoff(Upstream(session, FAST, metrics), prefill, decode, metrics,
                                      options=dict(peers_option(p1, p2)))
        req = GenerationRequest(endpoint=COMPLETIONS, body=BODY, encoded=json.dumps(BODY).encode(),
                                headers={"X-Request-Id": "r"}, request_id="r")
        route = PromptRoute(index=0, request=req, path=RoutePath.SPLIT, prefill=prefill.backends[1],
                            learner=answers)
        async with asyncio.timeout(LIMIT_S), handoff.serve(route) as reply:
            assert reply.backend is decode.backends[0] and reply.prefill_done is None
            assert (await reply.response.json())["served_by"] == "decode"
            assert reply.companion is not None
            await reply.companion
    assert route.prefill is prefill.backends[1] and route.decode is decode.backends[0]
    assert route.kv_transfer_params == d.received[0]["kv_transfer_params"]
    assert route.kv_transfer_params["remote_port"] == p2.kv_port and p1.received == []
    [(r, url, seconds, counted)] = seen
    assert r is route and url == p2.url and seconds > 0 and counted == 5
    assert all(b.outstanding == 0 for b in (*prefill.backends, *decode.backends))


# failures


async def test_prefill_client_error_before_decode_answered_reaches_client(streams, proxy, http) -> None:
    _p, d, server = await _pair(streams, proxy, p_kw={"fail_status": 400, "fail_early": True},
                                d_kw={"delay": 0.5})
    async with asyncio.timeout(LIMIT_S):
        async with http.post(server.url + "/v1/completions", json={**BODY, "stream": True}) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"] == {"message": "stand-in prefill failed on purpose",
                                                    "type": "StandInError", "param": None, "code": 400}
        await wait_for(lambda: d.aborted == 1 and d.running == 0)
    assert len(d.received) == 1                          # no fallback: the client's request is bad
    assert sample(server, "disagg_proxy_backend_in_flight", {"role": "decode", "url": d.url}) == 0


@pytest.mark.parametrize("fault", ["status500", "refused", "timeout", "down"])
async def test_prefill_failure_before_decode_answered_falls_back(fault, streams, proxy, http) -> None:
    p = await streams("prefill", fail_status=500 if fault == "status500" else None, hang=fault == "timeout")
    d = await streams("decode", delay=0.3 if fault == "refused" else 0.0)
    url = f"http://127.0.0.1:{free_port()}" if fault == "down" else p.url
    timeouts = {"timeout": ProxyTimeouts(connect=1, request=0.3, health_interval=60, health_timeout=1, drain=1),
                "refused": NO_PROBES}.get(fault, FAST)
    server = await proxy(prefill=[url], decode=[d.url], handoff="vllm-socket-stream", timeouts=timeouts,
                         handoff_options=peers_option(p))
    if fault == "refused":
        await p.stop()                                   # dies between two probes
    async with asyncio.timeout(LIMIT_S):
        async with http.post(server.url + "/v1/completions", json=BODY) as resp:
            assert resp.status == 200
            assert (await resp.json())["choices"][0]["text"] == "tok0 tok1 tok2 "
    reason = {"status500": "status", "refused": "connect", "timeout": "timeout", "down": "no_healthy_prefill"}[fault]
    assert sample(server, "disagg_proxy_fallbacks_total", {"reason": reason}) == 1
    assert sample(server, "disagg_proxy_requests_total", {"endpoint": "completions", "path": "fallback"}) == 1
    if fault == "down":
        assert d.received == [BODY]                      # nothing was sent before: decode alone at once
    else:
        first, fallback = d.received
        assert first["kv_transfer_params"]["transfer"] == "socket"
        assert fallback == BODY                          # decode alone: the client's request unchanged
        assert d.aborted == 1                            # the first decode request was closed
    if fault == "refused":
        assert not server.app_state.prefill.backends[0].healthy
    if fault == "timeout":
        await wait_for(lambda: p.aborted == 1 and p.running == 0)
    for role, u in (("prefill", url), ("decode", d.url)):
        assert sample(server, "disagg_proxy_backend_in_flight", {"role": role, "url": u}) == 0


async def test_prefill_failure_before_decode_answered_with_fallback_never_is_503(streams, proxy, http) -> None:
    _p, d, server = await _pair(streams, proxy, p_kw={"fail_status": 500}, fallback="never")
    async with asyncio.timeout(LIMIT_S):
        async with http.post(server.url + "/v1/completions", json=BODY) as resp:
            assert resp.status == 503
            assert "fallback is 'never'" in (await resp.json())["error"]["message"]
        await wait_for(lambda: d.aborted == 1 and d.running == 0)
    assert len(d.received) == 1


@pytest.mark.parametrize("status", [500, 400])
async def test_prefill_failure_after_decode_answered_leaves_decode_alone(status, streams, proxy, http,
                                                                          caplog) -> None:
    p, d, server = await _pair(streams, proxy, p_kw={"fail_status": status, "fail_delay": 0.3},
                               d_kw={"early_headers": True})
    caplog.set_level(logging.WARNING, logger="disagg.proxy")
    async with asyncio.timeout(LIMIT_S):
        async with http.post(server.url + "/v1/completions", json={**BODY, "stream": True}) as resp:
            assert resp.status == 200
            events = await read_events(resp)
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == ["tok0 ", "tok1 ", "tok2 "]
    assert events[-1] == "[DONE]"
    assert d.recomputed == 1 and d.aborted == 0 and len(d.received) == 1
    assert p.aborted == 0
    assert any("failed after decode" in r.getMessage() and p.url in r.getMessage() for r in caplog.records)
    assert sample(server, "disagg_proxy_requests_total", {"endpoint": "completions", "path": "split"}) == 1
    assert sample(server, "disagg_proxy_fallbacks_total", {"reason": "status"}) == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_a_prefill_still_running_when_decode_finished_is_cancelled(stream, streams, proxy, http,
                                                                         caplog) -> None:
    """Decode answers without the stream (its own prefix cache holds the prompt, or it gave up on a
    queued prefill): once its reply is relayed, prefill's request is cancelled, not awaited (the
    stand-in prefill would wait PEER_WAIT_S for a reader and then fail)."""
    p, d, server = await _pair(streams, proxy, d_kw={"local_hit": True})
    caplog.set_level(logging.INFO, logger="disagg.proxy")
    started = asyncio.get_running_loop().time()
    async with asyncio.timeout(LIMIT_S):
        async with http.post(server.url + "/v1/completions", json={**BODY, "stream": stream}) as resp:
            assert resp.status == 200
            if stream:
                events = await read_events(resp)
                assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == ["tok0 ", "tok1 ", "tok2 "]
            else:
                assert (await resp.json())["choices"][0]["text"] == "tok0 tok1 tok2 "
        await wait_for(lambda: p.aborted == 1 and p.running == 0)
    assert asyncio.get_running_loop().time() - started < PEER_WAIT_S  # prefill's request was not awaited
    assert d.aborted == 0 and d.recomputed == 0 and not p.outcome  # no reader came; prefill never answered
    assert sample(server, "disagg_proxy_prefills_dropped_total") == 1
    assert sample(server, "disagg_proxy_requests_total", {"endpoint": "completions", "path": "split"}) == 1
    assert any("prefill's request cancelled" in r.getMessage() and p.url in r.getMessage() for r in caplog.records)
    assert not any("failed after decode" in r.getMessage() for r in caplog.records)


async def test_a_prefill_that_answered_first_is_not_counted_as_dropped(streams, proxy, http) -> None:
    _p, _d, server = await _pair(streams, proxy)
    async with asyncio.timeout(LIMIT_S):
        for stream in (False, True):
            async with http.post(server.url + "/v1/completions", json={**BODY, "stream": stream}) as resp:
                assert resp.status == 200
                await resp.read()
    assert sample(server, "disagg_proxy_prefills_dropped_total") == 0


async def test_decode_error_status_is_relayed_and_prefill_closed(streams, proxy, http) -> None:
    p, _d, server = await _pair(streams, proxy, d_kw={"fail_status": 500})
    async with asyncio.timeout(LIMIT_S):
        async with http.post(server.url + "/v1/completions", json={**BODY, "stream": True}) as resp:
            assert resp.status == 500
            assert (await resp.json())["error"]["message"] == "stand-in decode failed on purpose"
        # prefill waited for a decode connection that never came: the proxy closed it
        await wait_for(lambda: p.aborted == 1 and p.running == 0)
    assert sample(server, "disagg_proxy_requests_total", {"endpoint": "completions", "path": "error"}) == 1


async def test_decode_refusing_the_connection_goes_to_the_next_decode(streams, proxy, http) -> None:
    p = await streams("prefill")
    d1, d2 = await streams("decode"), await streams("decode")
    server = await proxy(prefill=[p.url], decode=[d1.url, d2.url], handoff="vllm-socket-stream",
                         timeouts=NO_PROBES, handoff_options=peers_option(p))
    await d1.stop()
    async with asyncio.timeout(LIMIT_S):
        for _ in range(2):
            async with http.post(server.url + "/v1/completions", json=BODY) as resp:
                assert resp.status == 200
    assert len(p.received) == 2 and len(d2.received) == 2 and d2.recomputed == 0
    assert not server.app_state.decode.backends[0].healthy
    assert [b["kv_transfer_params"][STREAM_KEY] for b in d2.received] == \
        [b["kv_transfer_params"][STREAM_KEY] for b in p.received]


@pytest.mark.parametrize("decode_answered", [False, True])
async def test_client_leaving_closes_both_requests(decode_answered, streams, proxy, http) -> None:
    p, d, server = await _pair(streams, proxy, p_kw={"hang": True}, d_kw={"early_headers": decode_answered})
    body = {**BODY, "stream": True}
    async with asyncio.timeout(LIMIT_S):
        if decode_answered:
            resp = await http.post(server.url + "/v1/completions", json=body)
            assert resp.status == 200 and d.headers_sent == 1
            resp.close()
        else:
            task = asyncio.create_task(http.post(server.url + "/v1/completions", json=body))
            await wait_for(lambda: p.running == 1 and d.running == 1 and p.connected)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        await both_closed(server, p, d)


def test_handoff_option_cli_round_trip() -> None:
    from disagg.cli import build_parser
    from disagg.proxy import ProxyConfig

    config = ProxyConfig(decode=("http://d:1",), prefill=("http://p:1", "http://q:1"), handoff="vllm-socket-stream",
                         handoff_options=((KV_PEERS, "10.0.0.1:5601,[fe80::1]:5601"),))
    argv = config.to_argv()
    assert argv[argv.index("--handoff") + 1] == "vllm-socket-stream"
    assert ProxyConfig.from_args(build_parser().parse_args(argv)) == config

