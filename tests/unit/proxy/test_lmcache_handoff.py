"""The vLLM+LMCache handoff against stand-ins: a stand-in prefill that, like
LMCache's sender, pushes a msgpack ``ProxyNotif{req_id}`` to the proxy's ZMQ
socket per TP rank, and a stand-in decode; real LMCache P/D needs a GPU
(benchmarks/gpu/verify.sh)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio
from aiohttp import web
from proxy_standin import FAST, read_events

from disagg.errors import ProxyError
from disagg.proxy import ProxyTimeouts
from disagg.proxy.handoff import handoff_class
from disagg.proxy.lmcache_handoff import CLIENT_ID_CHARS, ID_RANDOM_HEX, LmcacheHandoff, parse_bind, parse_receivers
from harness.ports import free_port

LIMIT_S = 8.0


class ProxyNotif(msgspec.Struct, tag=True):
    """The shape of LMCache's notice (lmcache.v1.storage_backend.pd_backend_async.ProxyNotif)."""

    req_id: str


class StandInLmcacheVllm:
    """Stand-in vLLM+LMCache server: prefill (kv_transfer_params.disagg_spec) or decode."""

    def __init__(self, notify: str | None = None, notices: int = 1) -> None:
        self.notify, self.notices = notify, notices
        self.received: list[dict[str, Any]] = []
        self.order: list[str] = []
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._ctx = zmq.asyncio.Context()

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/completions", self._generate)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        self._ctx.term()

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
        spec = (body.get("kv_transfer_params") or {}).get("disagg_spec")
        if spec is not None and self.notify:                       # prefill: "push KV", then notify
            sock = self._ctx.socket(zmq.PUSH)
            sock.connect(self.notify)
            for _ in range(self.notices):
                await sock.send(msgspec.msgpack.encode(ProxyNotif(req_id=spec["req_id"])))
            sock.close(linger=1000)
            return web.json_response({"id": "p", "choices": [{"text": "A"}],
                                      "kv_transfer_params": {"first_tok": 65}})
        self.order.append("decode")
        if body.get("stream"):
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            for t in ("A", "B"):
                await out.write(f'data: {{"choices": [{{"text": "{t}"}}]}}\n\n'.encode())
            await out.write(b"data: [DONE]\n\n")
            return out
        return web.json_response({"choices": [{"text": "AB"}], "served_by": "decode"})


@pytest.fixture
async def pair(proxy):
    made: list[StandInLmcacheVllm] = []

    async def make(notices: int = 1, tp: int = 1, timeouts: ProxyTimeouts = FAST):
        port = free_port()
        p = StandInLmcacheVllm(notify=f"tcp://127.0.0.1:{port}", notices=notices)
        d = StandInLmcacheVllm()
        for s in (p, d):
            await s.start()
            made.append(s)
        receivers = json.dumps([{"host": "10.0.0.2", "init": [7300 + r for r in range(tp)],
                                 "alloc": [7400 + r for r in range(tp)]}])
        server = await proxy(prefill=[p.url], decode=[d.url], handoff="vllm-lmcache", timeouts=timeouts,
                             handoff_options=(("receivers", receivers),
                                              ("notify", f"127.0.0.1:{port}")))
        return p, d, server

    yield make
    for s in made:
        await s.stop()


def test_registered_for_vllm_lmcache() -> None:
    assert handoff_class("vllm-lmcache") is LmcacheHandoff


def test_option_parsing() -> None:
    rec = parse_receivers(("http://d:1",), '[{"host": "10.0.0.2", "init": [7300, 7301], "alloc": [7302, 7303]}]'
                          )["http://d:1"]
    assert (rec.host, rec.init_ports, rec.alloc_ports) == ("10.0.0.2", (7300, 7301), (7302, 7303))
    assert parse_bind("0.0.0.0:8001") == "tcp://0.0.0.0:8001"
    bad_items = ({"host": "h", "init": [1]}, {"host": "", "init": [1], "alloc": [2]},
                 {"host": "h", "init": [1, 2], "alloc": [3]}, {"host": "h", "init": [0], "alloc": [2]},
                 {"host": "h", "init": [True], "alloc": [2]}, {"host": "h", "init": ["1"], "alloc": [2]},
                 {"host": "h", "init": [], "alloc": []}, {"host": 1, "init": [1], "alloc": [2]},
                 {"host": "h", "init": [1], "alloc": [2], "x": 1})
    for bad in (None, "", "h:1:2", "{}", "[]", "[1]", json.dumps([{"host": "h", "init": [1], "alloc": [2]}] * 2),
                *(json.dumps([item]) for item in bad_items)):
        with pytest.raises(ProxyError):
            parse_receivers(("http://d:1",), bad)
    with pytest.raises(ProxyError):
        parse_bind("8001")


async def test_prefill_gets_disagg_spec_decode_the_client_request(pair, http) -> None:
    p, d, server = await pair()
    body = {"model": "m", "prompt": "hi", "max_tokens": 2, "stream": True}
    async with asyncio.timeout(LIMIT_S):
        async with http.post(server.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            events = await read_events(resp)
    assert events[-1] == "[DONE]" and len(events) == 3
    (pb,), (db,) = p.received, d.received
    spec = pb["kv_transfer_params"]["disagg_spec"]
    assert pb["kv_transfer_params"]["ret_first_tok"] is True and pb["max_tokens"] == 1 and pb["stream"] is False
    assert (spec["receiver_host"], spec["receiver_init_port"], spec["receiver_alloc_port"]) == \
        ("10.0.0.2", [7300], [7400])
    assert db == body                                   # decode: the client's request, unchanged


async def test_waits_for_one_notice_per_tp_rank(pair, http) -> None:
    p, d, server = await pair(notices=2, tp=2)
    async with asyncio.timeout(LIMIT_S):
        async with http.post(server.url + "/v1/completions", json={"prompt": "x"}) as resp:
            assert (await resp.json())["served_by"] == "decode"
    assert d.order == ["decode"] and len(p.received) == 1


async def test_missing_notice_falls_back_to_decode_alone(pair, http) -> None:
    short = ProxyTimeouts(connect=1.0, request=0.5, health_interval=0.1, health_timeout=1.0, drain=1.0)
    _p, d, server = await pair(notices=1, tp=2, timeouts=short)     # 1 of 2 notices arrives
    async with asyncio.timeout(LIMIT_S):
        async with http.post(server.url + "/v1/completions", json={"prompt": "x"}) as resp:
            assert resp.status == 200
    metrics = server.app_state.metrics.render().decode()
    assert 'reason="no_kv_notice"' in metrics
    assert d.received == [{"prompt": "x"}]
    assert server.app_state.handoff.notices.awaited == 0         # the prompt's wait is over: nothing kept


async def test_a_long_client_request_id_is_cut_in_lmcaches_id(pair, http) -> None:
    p, _d, server = await pair()
    client_id = "c" * 128  # the longest the proxy passes on
    async with asyncio.timeout(LIMIT_S):
        async with http.post(server.url + "/v1/completions", json={"prompt": "x"},
                             headers={"X-Request-Id": client_id}) as resp:
            assert (await resp.json())["served_by"] == "decode"
    req_id = p.received[0]["kv_transfer_params"]["disagg_spec"]["req_id"]
    prefix = f"disagg-{client_id[:CLIENT_ID_CHARS]}-"
    assert req_id.startswith(prefix) and len(req_id) == len(prefix) + ID_RANDOM_HEX
    assert 'disagg_proxy_fallbacks_total{reason="no_kv_notice"}' not in server.app_state.metrics.render().decode()


async def test_a_notice_nobody_awaits_is_counted_in_the_metrics(pair) -> None:
    p, _d, server = await pair()
    await asyncio.to_thread(_push_once, p.notify, msgspec.msgpack.encode(ProxyNotif(req_id="disagg-spoofed")))
    line = 'disagg_proxy_lmcache_notices_dropped_total{reason="unawaited"} 1.0'
    async with asyncio.timeout(LIMIT_S):
        while line not in server.app_state.metrics.render().decode():
            await asyncio.sleep(0.01)
    assert server.app_state.handoff.notices.awaited == 0


def _push_once(endpoint: str, msg: bytes) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(endpoint)
    sock.send(msg)
    sock.close(linger=int(LIMIT_S * 1000))
    ctx.term()


async def test_notify_port_in_use_fails_at_start(proxy) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(ProxyError, match="cannot listen for LMCache notices"):
            await proxy(prefill=["http://127.0.0.1:1"], decode=["http://127.0.0.1:2"], handoff="vllm-lmcache",
                        handoff_options=(("receivers", '[{"host": "h", "init": [1], "alloc": [2]}]'),
                                         ("notify", f"127.0.0.1:{port}")))
    finally:
        sock.close(linger=0)
        ctx.term()
