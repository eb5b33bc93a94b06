"""The NIXL push handoff (``--handoff vllm-nixl-push``) against stand-ins that keep vLLM 0.32's
push protocol's shape (nixl_push_standin.py): decode registers with the prefill engine whose
coordinates the proxy learned from its replies, prefill WRITEs when it finishes; decode's reply
waits for prefill's."""

from __future__ import annotations

import asyncio
import functools
import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from nixl_push_standin import PushStandIn, answer_text
from proxy_standin import FAST, both_closed, healthy_pools, read_events, sample, wait_for

from disagg.proxy import ProxyServer, ProxyTimeouts
from disagg.proxy.handoff import COMPLETIONS, VllmHandoff, handoff_class
from disagg.proxy.nixl_push_handoff import NixlPushHandoff, PushPeer, push_request_id
from disagg.proxy.routes import GenerationRequest, PromptRoute, RoutePath
from disagg.proxy.upstream import Upstream, make_session
from harness.ports import free_port
from tests.unit.proxy.learner import PrefillAnswers

#: no test may take longer than this (nothing hangs)
LIMIT_S = 8.0
BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 3}
HELLO = "".join(answer_text("hello", 3))
#: health probes that do not run during the test (a backend stays as the request finds it)
NO_PROBES = ProxyTimeouts(connect=1.0, request=5.0, health_interval=60.0, health_timeout=1.0, drain=1.0)
#: vLLM's own request-id suffix, which its push worker strips before matching (nixl/utils.py)
VLLM_SUFFIX = re.compile(r"-[0-9a-f]{8}$", re.IGNORECASE)


@pytest.fixture
def pushes(started: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[PushStandIn]]:
    """Factory of started stand-ins, stopped after the test."""
    return functools.partial(started, PushStandIn)


#: a prefill stand-in's compute time where a test orders decode's arrival before prefill's answer
SLOW_PREFILL_S = 0.5


async def _pair(pushes: Any, proxy: Any, p_kw: dict[str, Any] | None = None, d_kw: dict[str, Any] | None = None,
                **proxy_kw: Any) -> tuple[PushStandIn, PushStandIn, ProxyServer]:
    p = await pushes("prefill", **(p_kw or {}))
    d = await pushes("decode", **(d_kw or {}))
    server = await proxy(prefill=[p.url], decode=[d.url], handoff="vllm-nixl-push", **proxy_kw)
    return p, d, server


async def _post(http: Any, server: ProxyServer, body: dict[str, Any] | None = None, **kw: Any) -> tuple[int, Any]:
    async with http.post(server.url + "/v1/completions", json=body or BODY, **kw) as resp:
        return resp.status, await resp.json()


async def _learned(http: Any, server: ProxyServer, p: PushStandIn, d: PushStandIn) -> None:
    """One request served in turn, so the proxy knows the prefill engine; the stand-ins forget it."""
    assert await _post(http, server) == (200, _reply_of(HELLO))
    for side in (p, d):
        side.received.clear()
        side.request_ids.clear()
        side.arrived.clear()
        side.answered.clear()


def _reply_of(text: str) -> Any:
    return {"id": "d", "object": "text_completion", "model": "tiny", "served_by": "decode",
            "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}


def decode_params(p: PushStandIn) -> dict[str, Any]:
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": p.engine_id,
            "remote_host": "127.0.0.1", "remote_port": p.kv_port, "tp_size": 1, "pp_size": 1, "dcp_size": 1,
            "remote_request_id": None, "remote_block_ids": None}


PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}


# the registry, the request ids, the coordinates


def test_registered_for_vllm_nixl_push() -> None:
    assert handoff_class("vllm-nixl-push") is NixlPushHandoff
    assert NixlPushHandoff.kind == "vllm-nixl-push" and NixlPushHandoff.serves_local
    assert NixlPushHandoff.hold_decode


def test_push_request_ids_are_fresh_and_survive_vllms_suffix_stripping() -> None:
    ids = {push_request_id("r1") for _ in range(200)}
    assert len(ids) == 200
    for rid in ids:
        assert re.fullmatch(r"r1-push[0-9a-f]{16}", rid)
        # what vLLM 0.32 matches on: the internal id less its own random suffix
        assert VLLM_SUFFIX.sub("", f"cmpl-{rid}-0-89abcdef") == f"cmpl-{rid}-0"
        assert VLLM_SUFFIX.sub("", f"chatcmpl-{rid}-89abcdef") == f"chatcmpl-{rid}"
        assert VLLM_SUFFIX.sub("", rid) == rid     # never taken for vLLM's suffix itself


PUSH_REPLY = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1]],
              "remote_engine_id": "e-1", "remote_request_id": "cmpl-x-0-1234abcd", "remote_host": "10.0.0.1",
              "remote_port": 5601, "tp_size": 2, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": 4,
              "transfer_mode": "push"}


def test_push_peer_from_a_push_reply() -> None:
    assert PushPeer.from_params(PUSH_REPLY) == PushPeer("e-1", "10.0.0.1", 5601, 2, 1, 1)
    without_sizes = {k: v for k, v in PUSH_REPLY.items() if k not in ("pp_size", "dcp_size")}
    assert PushPeer.from_params(without_sizes) == PushPeer("e-1", "10.0.0.1", 5601, 2)


@pytest.mark.parametrize("change", [
    {"transfer_mode": "pull"}, {"transfer_mode": None}, {"remote_engine_id": None}, {"remote_engine_id": ""},
    {"remote_engine_id": 7}, {"remote_host": ""}, {"remote_host": None}, {"remote_port": "5601"},
    {"remote_port": 0}, {"remote_port": 70000}, {"remote_port": True}, {"tp_size": 0}, {"tp_size": "2"},
    {"pp_size": None}, {"dcp_size": 1.0},
])
def test_push_peer_refuses_what_is_not_a_push_reply(change: dict[str, Any]) -> None:
    assert PushPeer.from_params({**PUSH_REPLY, **change}) is None


@pytest.mark.parametrize("params", [None, [], "push", {}])
def test_push_peer_refuses_non_objects(params: object) -> None:
    assert PushPeer.from_params(params) is None


# the protocol


async def test_first_route_in_turn_then_both_at_once_with_the_learned_coordinates(pushes, proxy, http) -> None:
    # prefill computes long enough that decode's registration (a new session, a POST) comes first
    # even on a loaded machine: the stand-in answers without waiting for it
    p, d, server = await _pair(pushes, proxy, p_kw={"compute_s": SLOW_PREFILL_S})
    async with asyncio.timeout(LIMIT_S):
        assert await _post(http, server, headers={"X-Request-Id": "r1"}) == (200, _reply_of(HELLO))
        # in turn: the proxy did not know the prefill engine; decode got prefill's reply unchanged
        (pb1,), (db1,) = p.received, d.received
        assert pb1 == VllmHandoff.prefill_body(COMPLETIONS, BODY, PREFILL_PARAMS)
        assert d.arrived[0] > p.answered[0]
        assert db1["kv_transfer_params"]["remote_engine_id"] == "engine-a"
        assert db1["kv_transfer_params"]["remote_request_id"] == f"cmpl-{p.request_ids[0]}-0-1234abcd"
        body = {**BODY, "prompt": "second", "stream": True, "stream_options": {"include_usage": True}}
        async with http.post(server.url + "/v1/completions", json=body, headers={"X-Request-Id": "r2"}) as resp:
            assert resp.status == 200 and resp.headers["X-Request-Id"] == "r2"
            events = await read_events(resp)
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == answer_text("second", 3)
    assert events[-1] == "[DONE]"
    _, pb2 = p.received
    _, db2 = d.received
    assert pb2 == VllmHandoff.prefill_body(COMPLETIONS, body, PREFILL_PARAMS)
    assert db2 == {**body, "kv_transfer_params": decode_params(p)}
    # at once: decode registered before prefill answered, and prefill WROTE into it
    assert d.arrived[1] < p.answered[1] and d.registered[1] < p.answered[1]
    assert p.written == 2 and d.recomputed == 0 and p.aborted == d.aborted == 0
    # both engines saw one fresh id per route, the client's id in front
    assert p.request_ids == d.request_ids
    assert [rid.split("-push")[0] for rid in p.request_ids] == ["r1", "r2"]
    assert len(set(p.request_ids)) == 2 and all(re.fullmatch(r"r\d-push[0-9a-f]{16}", r) for r in p.request_ids)
    assert sample(server, "disagg_proxy_requests_total", {"endpoint": "completions", "path": "split"}) == 2
    assert sample(server, "disagg_proxy_prefill_seconds_count") == 2
    assert sample(server, "disagg_proxy_handoff_seconds_count") == 1       # the streamed one
    for role, url in (("prefill", p.url), ("decode", d.url)):
        assert sample(server, "disagg_proxy_backend_in_flight", {"role": role, "url": url}) == 0


async def test_a_reused_client_request_id_never_crosses_kv(pushes, proxy, http) -> None:
    """vLLM matches a registration to a prefill by request id alone: two requests under one
    client X-Request-Id at once must each get their own prompt's KV."""
    p, d, server = await _pair(pushes, proxy, p_kw={"compute_s": 0.2})
    async with asyncio.timeout(LIMIT_S):
        await _learned(http, server, p, d)
        prompts = ["alpha", "beta", "gamma"]
        replies = await asyncio.gather(*(_post(http, server, {**BODY, "prompt": t}, headers={"X-Request-Id": "same"})
                                         for t in prompts))
    assert list(replies) == [(200, _reply_of("".join(answer_text(t, 3)))) for t in prompts]
    assert len(set(d.request_ids)) == 3 and sorted(p.request_ids) == sorted(d.request_ids)
    assert d.recomputed == 0 and p.written == 4


@pytest.mark.parametrize("stream", [False, True])
async def test_the_reply_id_is_a_colocated_servers(stream, pushes, proxy, http) -> None:
    """vLLM builds a reply's id from X-Request-Id: the fresh -push suffix the engines saw never
    reaches the client, in the route served in turn nor in those served at once."""
    p, d, server = await _pair(pushes, proxy, d_kw={"ids_from_header": True})
    async with asyncio.timeout(LIMIT_S):
        for rid in ("abc", "def"):                        # the first in turn, the second at once
            async with http.post(server.url + "/v1/completions", json={**BODY, "stream": stream},
                                 headers={"X-Request-Id": rid}) as resp:
                assert resp.status == 200 and resp.headers["X-Request-Id"] == rid
                if stream:
                    events = await read_events(resp)
                    assert events[-1] == "[DONE]" and len(events) == 4
                    ids = [json.loads(e)["id"] for e in events[:-1]]
                    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
                else:
                    body = await resp.json()
                    ids, text = [body["id"]], body["choices"][0]["text"]
            assert ids == [f"cmpl-{rid}"] * len(ids) and text == HELLO
    assert [r.split("-push")[0] for r in d.request_ids] == ["abc", "def"]   # the engines saw the suffix
    assert all(re.fullmatch(r"(abc|def)-push[0-9a-f]{16}", r) for r in d.request_ids)
    assert p.written == 2 and d.recomputed == 0


async def test_serve_records_engines_params_and_when_prefill_answered(pushes) -> None:
    """Direct use: the routing policy's presets are used while healthy; the route records the
    engines and decode's kv_transfer_params; the route's learner gets prefill's time and count; the
    reply's prefill_done is when prefill answered (no companion: it is over)."""
    p1, p2, d = await pushes("prefill", engine_id="one"), await pushes("prefill", engine_id="two"), \
        await pushes("decode")
    metrics, prefill, decode = healthy_pools([p1.url, p2.url], [d.url])
    answers = PrefillAnswers()
    seen = answers.seen
    async with make_session(FAST) as session:
        handoff = NixlPushHandoff(Upstream(session, FAST, metrics), prefill, decode, metrics)
        routes = []
        for _ in range(2):
            req = GenerationRequest(endpoint=COMPLETIONS, body=BODY, encoded=json.dumps(BODY).encode(),
                                    headers={"X-Request-Id": "r"}, request_id="r")
            route = PromptRoute(index=0, request=req, path=RoutePath.SPLIT, prefill=prefill.backends[1],
                                learner=answers)
            async with asyncio.timeout(LIMIT_S), handoff.serve(route) as reply:
                assert reply.backend is decode.backends[0] and reply.companion is None
                assert reply.prefill_done is not None
                assert (await reply.response.json())["choices"][0]["text"] == HELLO
            routes.append(route)
    assert p1.received == [] and len(p2.received) == 2
    assert handoff.peers == {p2.url: PushPeer("two", "127.0.0.1", p2.kv_port, 1, 1, 1)}
    first, second = routes
    assert first.kv_transfer_params is not None and first.kv_transfer_params["remote_request_id"].startswith("cmpl-")
    assert second.kv_transfer_params == decode_params(p2) == d.received[1]["kv_transfer_params"]
    assert all(r.prefill is prefill.backends[1] and r.decode is decode.backends[0] for r in routes)
    assert [(r, url, n) for r, url, _s, n in seen] == [(first, p2.url, 5), (second, p2.url, 5)]
    assert all(s > 0 for *_, s, _n in seen)
    assert all(b.outstanding == 0 for b in (*prefill.backends, *decode.backends))


async def test_a_prefill_back_in_service_is_learned_again(pushes, proxy, http) -> None:
    p, d, server = await _pair(pushes, proxy, timeouts=NO_PROBES)
    handoff = server.app_state.handoff
    assert isinstance(handoff, NixlPushHandoff)
    async with asyncio.timeout(LIMIT_S):
        await _learned(http, server, p, d)
        assert p.url in handoff.peers
        backend = server.app_state.prefill.backends[0]
        server.app_state.prefill.mark_down(backend, "probe failed")
        p.engine_id = "engine-b"                          # restarted: a new engine id
        server.app_state.prefill.mark_up(backend)
        assert handoff.peers == {}
        assert await _post(http, server) == (200, _reply_of(HELLO))
    assert d.arrived[0] > p.answered[0]                   # in turn again
    assert d.received[0]["kv_transfer_params"]["remote_engine_id"] == "engine-b"
    assert handoff.peers[p.url].engine_id == "engine-b" and d.recomputed == 0


# failures


async def test_prefill_client_error_reaches_the_client_though_decode_answered(pushes, proxy, http) -> None:
    p, d, server = await _pair(pushes, proxy)
    async with asyncio.timeout(LIMIT_S):
        await _learned(http, server, p, d)
        p.fail_status = 400
        async with http.post(server.url + "/v1/completions", json={**BODY, "stream": True}) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"] == {"message": "stand-in prefill failed on purpose",
                                                    "type": "StandInError", "param": None, "code": 400}
        await wait_for(lambda: d.aborted == 1 and d.running == 0)
    assert len(d.received) == 1 and d.registered        # decode had registered; no fallback for a bad request
    assert sample(server, "disagg_proxy_backend_in_flight", {"role": "decode", "url": d.url}) == 0


@pytest.mark.parametrize("fault", ["status500", "refused", "timeout", "down"])
async def test_prefill_failure_closes_the_waiting_decode_and_falls_back(fault, pushes, proxy, http) -> None:
    p, d = await pushes("prefill"), await pushes("decode")
    url = p.url
    if fault == "down":
        url = f"http://127.0.0.1:{free_port()}"
    timeouts = {"timeout": ProxyTimeouts(connect=1, request=0.5, health_interval=60, health_timeout=1, drain=1),
                "refused": NO_PROBES}.get(fault, FAST)
    server = await proxy(prefill=[url], decode=[d.url], handoff="vllm-nixl-push", timeouts=timeouts)
    handoff = server.app_state.handoff
    assert isinstance(handoff, NixlPushHandoff)
    if fault != "down":
        async with asyncio.timeout(LIMIT_S):
            await _learned(http, server, p, d)
    body = {**BODY, "stream": True}
    if fault == "status500":
        p.fail_status = 500
    elif fault == "timeout":
        p.hang = True
    elif fault == "refused":
        await p.stop()                                   # dies between two probes (its side channel too)
    async with asyncio.timeout(LIMIT_S):
        async with http.post(server.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            events = await read_events(resp)
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == answer_text("hello", 3)
    reason = {"status500": "status", "refused": "connect", "timeout": "timeout", "down": "no_healthy_prefill"}[fault]
    assert sample(server, "disagg_proxy_fallbacks_total", {"reason": reason}) == 1
    assert sample(server, "disagg_proxy_requests_total", {"endpoint": "completions", "path": "fallback"}) == 1
    if fault == "down":
        assert d.received == [body]                      # nothing was sent before: decode alone at once
    elif fault == "refused":                             # decode's request may not have arrived before it was closed
        *first, fallback = d.received
        assert fallback == body and all(b["kv_transfer_params"] == decode_params(p) for b in first)
        assert not server.app_state.prefill.backends[0].healthy
    else:
        first, fallback = d.received
        assert first["kv_transfer_params"] == decode_params(p)
        assert fallback == body                          # decode alone: the client's request unchanged
        await wait_for(lambda: d.aborted == 1)           # the waiting decode request was closed
    if fault == "timeout":
        await wait_for(lambda: p.aborted == 1 and p.running == 0)
    await wait_for(lambda: d.running == 0)
    for role, u in (("prefill", url), ("decode", d.url)):
        assert sample(server, "disagg_proxy_backend_in_flight", {"role": role, "url": u}) == 0


async def test_prefill_failure_with_fallback_never_is_503(pushes, proxy, http) -> None:
    p, d, server = await _pair(pushes, proxy, fallback="never")
    async with asyncio.timeout(LIMIT_S):
        await _learned(http, server, p, d)
        p.fail_status = 500
        status, body = await _post(http, server)
        assert status == 503 and "fallback is 'never'" in body["error"]["message"]
        await wait_for(lambda: d.aborted == 1 and d.running == 0)
    assert len(d.received) == 1


async def test_a_restart_the_proxy_missed_fails_over_to_decode_alone_and_is_learned(pushes, proxy, http) -> None:
    """Prefill restarted between two probes (a new engine id): decode registered with the old one and
    would wait for ever; prefill's reply shows it, decode alone serves, the next route is right."""
    p, d, server = await _pair(pushes, proxy, p_kw={"compute_s": SLOW_PREFILL_S}, timeouts=NO_PROBES)
    async with asyncio.timeout(LIMIT_S):
        await _learned(http, server, p, d)
        p.engine_id = "engine-b"
        assert await _post(http, server) == (200, _reply_of(HELLO))
        assert sample(server, "disagg_proxy_fallbacks_total", {"reason": "peer_changed"}) == 1
        await wait_for(lambda: d.running == 0)
        nxt = await _post(http, server, {**BODY, "prompt": "next"})
        assert nxt == (200, _reply_of("".join(answer_text("next", 3))))
    stale, alone, right = d.received
    assert stale["kv_transfer_params"]["remote_engine_id"] == "engine-a" and "kv_transfer_params" not in alone
    assert right["kv_transfer_params"] == decode_params(p)            # engine-b, at once
    assert d.arrived[2] < p.answered[1]
    assert sample(server, "disagg_proxy_fallbacks_total", {"reason": "peer_changed"}) == 1


@pytest.mark.parametrize("mode", ["pull", "none"])
async def test_a_prefill_that_is_not_push_mode_falls_back(mode, pushes, proxy, http) -> None:
    _p, d, server = await _pair(pushes, proxy, p_kw={"reply_mode": mode})
    async with asyncio.timeout(LIMIT_S):
        assert await _post(http, server) == (200, _reply_of(HELLO))
    assert d.received == [BODY]                          # decode alone, never told to wait for a push
    assert sample(server, "disagg_proxy_fallbacks_total", {"reason": "no_kv_params"}) == 1
    assert server.app_state.handoff.peers == {}


async def test_decode_error_status_is_relayed_and_prefill_closed(pushes, proxy, http) -> None:
    p, d, server = await _pair(pushes, proxy)
    async with asyncio.timeout(LIMIT_S):
        await _learned(http, server, p, d)
        d.fail_status, p.hang = 500, True
        status, body = await _post(http, server, {**BODY, "stream": True})
        assert status == 500 and body["error"]["message"] == "stand-in decode failed on purpose"
        await wait_for(lambda: p.aborted == 1 and p.running == 0)
    assert sample(server, "disagg_proxy_requests_total", {"endpoint": "completions", "path": "error"}) == 1


async def test_client_leaving_closes_both_requests(pushes, proxy, http) -> None:
    p, d, server = await _pair(pushes, proxy, p_kw={"compute_s": 3600})
    handoff = server.app_state.handoff
    assert isinstance(handoff, NixlPushHandoff)
    handoff.peers[p.url] = PushPeer(p.engine_id, "127.0.0.1", p.kv_port, 1)
    async with asyncio.timeout(LIMIT_S):
        task = asyncio.create_task(http.post(server.url + "/v1/completions", json={**BODY, "stream": True}))
        await wait_for(lambda: p.running == 1 and d.running == 1 and len(d.registered) == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await both_closed(server, p, d)


def test_cli_round_trip() -> None:
    from disagg.cli import build_parser
    from disagg.proxy import ProxyConfig

    config = ProxyConfig(decode=("http://d:1",), prefill=("http://p:1", "http://q:1"), handoff="vllm-nixl-push")
    argv = config.to_argv()
    assert argv[argv.index("--handoff") + 1] == "vllm-nixl-push"
    assert ProxyConfig.from_args(build_parser().parse_args(argv)) == config
