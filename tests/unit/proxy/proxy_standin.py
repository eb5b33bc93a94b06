"""Stand-in engines for the proxy tests.

A :class:`StandInEngine` is a small aiohttp server speaking the slice of
vLLM's HTTP API the proxy uses. It is a stand-in, not an engine: it exists for
what a real vLLM cannot do on demand here (refuse, fail with a chosen status,
die mid-stream, hang, report a client abort at once) and for recording the
exact bodies and headers the proxy sent. Real-engine behaviour is covered by
tests/e2e.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from disagg.proxy import ProxyTimeouts
from disagg.proxy.backends import BackendPool
from disagg.proxy.metrics import ProxyMetrics


class ServedApps:
    """The aiohttp apps of one stand-in (its HTTP API, a KV or bootstrap listener), each on a free
    127.0.0.1 port, stopped together; the stand-ins of the concurrent handoffs serve through it."""

    def __init__(self) -> None:
        self._runners: list[web.AppRunner] = []

    async def serve(self, app: web.Application) -> int:
        """Start ``app``; its port."""
        runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.5)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        self._runners.append(runner)
        return int(runner.addresses[0][1])

    async def stop(self) -> None:
        for runner in self._runners:
            await runner.cleanup()
        self._runners.clear()


async def _ok(request: web.Request) -> web.Response:
    return web.Response(text="ok")


def engine_app(generate: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.Application:
    """A stand-in engine's HTTP API: ``GET /health`` (always ok) and both generation routes to ``generate``."""
    app = web.Application()
    app.router.add_get("/health", _ok)
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    return app


@dataclass
class RoleStandIn:
    """A stand-in engine in one role (``mode`` prefill or decode) of a concurrent handoff: its API
    (:func:`engine_app`) and listeners served by :class:`ServedApps`; every generation request
    recorded (body, ``X-Request-Id``, arrival) and counted while it runs, and as ``aborted`` when
    the proxy closed it. Subclasses implement ``start``, ``_prefill`` and ``_decode``."""

    mode: str
    tokens: int = 3
    fail_status: int | None = None     # answer generation with this status
    received: list[dict[str, Any]] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)
    arrived: list[float] = field(default_factory=list)    # loop time of each generation request
    answered: list[float] = field(default_factory=list)   # prefill: loop time of each 200 answer
    recomputed: int = 0
    aborted: int = 0
    running: int = 0
    url: str = ""
    kv_port: int = 0
    _apps: ServedApps = field(default_factory=ServedApps)

    async def stop(self) -> None:
        await self._apps.stop()

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
        self.request_ids.append(request.headers.get("X-Request-Id", ""))
        self.arrived.append(asyncio.get_running_loop().time())
        self.running += 1
        try:
            if self.mode == "prefill":
                return await self._prefill(request, body)
            return await self._decode(request, body)
        except (asyncio.CancelledError, ConnectionResetError):  # the proxy closed the request
            self.aborted += 1
            raise
        finally:
            self.running -= 1

    async def _prefill(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        raise NotImplementedError

    async def _decode(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        raise NotImplementedError

    def _error(self) -> web.Response:
        return web.json_response({"error": {"message": f"stand-in {self.mode} failed on purpose",
                                            "type": "StandInError", "param": None, "code": self.fail_status}},
                                 status=self.fail_status or 500)

    async def _reply(self, text: list[str], out: web.StreamResponse | None, reply_id: str = "d"
                     ) -> web.StreamResponse:
        """Decode's answer of ``text``: one JSON body, or into ``out`` (a stream already prepared)
        an event per token, then ``[DONE]``; ``reply_id`` is the body's and each event's ``id``."""
        if out is None:
            return web.json_response({"id": reply_id, "object": "text_completion", "model": "tiny",
                                      "served_by": "decode",
                                      "choices": [{"index": 0, "text": "".join(text), "finish_reason": "length"}],
                                      "usage": {"prompt_tokens": 5, "completion_tokens": self.tokens,
                                                "total_tokens": 5 + self.tokens}})
        for t in text:
            chunk = {"id": reply_id, "model": "tiny", "choices": [{"index": 0, "text": t, "finish_reason": None}]}
            await out.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out


def healthy_pools(prefill: list[str], decode: list[str]) -> tuple[ProxyMetrics, BackendPool, BackendPool]:
    """Metrics and a prefill and a decode pool of these URLs, every backend in service (for a
    handoff used directly, without a proxy or its health probes)."""
    metrics = ProxyMetrics()
    pools = BackendPool("prefill", prefill, metrics), BackendPool("decode", decode, metrics)
    for pool in pools:
        for b in pool.backends:
            pool.mark_up(b)
    return metrics, *pools


def sample(server: Any, name: str, labels: dict[str, str] | None = None) -> float:
    """One sample of a proxy's (a ``ProxyServer``'s) metrics, 0 when absent."""
    value = server.app_state.metrics.registry.get_sample_value(name, labels or {})
    return 0.0 if value is None else float(value)


async def both_closed(server: Any, p: RoleStandIn, d: RoleStandIn) -> None:
    """The proxy closed the prefill and the decode request: neither runs any more, each was
    cancelled once, and the proxy counts nothing in flight on either."""
    await wait_for(lambda: p.running == 0 and d.running == 0)
    assert p.aborted == 1 and d.aborted == 1
    for role, url in (("prefill", p.url), ("decode", d.url)):
        await wait_for(lambda role=role, url=url: sample(
            server, "disagg_proxy_backend_in_flight", {"role": role, "url": url}) == 0)


@dataclass
class Received:
    """One request a stand-in got."""

    method: str
    path: str
    headers: CIMultiDict[str]
    body: Any


@dataclass
class StandInEngine:
    """A stand-in vLLM server: prefill when ``kv_transfer_params.do_remote_decode``
    is set, otherwise a generator of ``tokens`` tokens (``tok0 tok1 ...``)."""

    name: str
    tokens: int = 4
    token_delay: float = 0.0
    health_status: int = 200
    health_delay: float = 0.0               # seconds before /health answers (a busy engine);
                                            # lowering it answers the probes already waiting
    fail_status: int | None = None          # answer generation with this error status
    die_after: int | None = None            # drop the connection after this many stream events
    hang: bool = False                      # never answer generation
    no_kv_params: bool = False              # prefill answers without kv_transfer_params
    gate: asyncio.Event | None = None       # stream: wait for it after the first event
    prompt_text: bool = False               # tokens carry the (string) prompt: ``<prompt>:tok0 ``
    keep_bodies: bool = True                # False: record requests without their bodies (large batches)
    kv_blocks: int | None = None            # /metrics declares a KV cache of this many 16-token blocks
    fail_on_prompt: str | None = None       # answer 400 to a request whose prompt is this string
    received: list[Received] = field(default_factory=list)
    running: int = 0                        # generation requests in progress
    aborted: int = 0                        # generation requests cancelled by the caller leaving
    url: str = ""
    _runner: web.AppRunner | None = None

    def generations(self) -> list[Received]:
        return [r for r in self.received if r.path.startswith("/v1/") and "completions" in r.path]

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)   # as vLLM: large bodies are read
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/version", self._version)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/tokenize", self._echo)
        app.router.add_post("/detokenize", self._echo)
        app.router.add_route("*", "/v1/{tail:.*}", self._echo)
        app.router.add_route("*", "/{tail:.*}", self._echo)  # any other path: recorded, so a test sees it arrive
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _record(self, request: web.Request) -> Any:
        raw = await request.read()
        try:
            body = json.loads(raw) if raw else None
        except (ValueError, RecursionError):
            body = None
        self.received.append(Received(request.method, request.path_qs, CIMultiDict(request.headers),
                                      body if self.keep_bodies else None))
        return body

    async def _health(self, request: web.Request) -> web.Response:
        loop = asyncio.get_running_loop()
        asked = loop.time()
        while loop.time() - asked < self.health_delay:   # read again: a test may lower it meanwhile
            await asyncio.sleep(0.01)
        return web.Response(status=self.health_status)

    async def _models(self, request: web.Request) -> web.Response:
        await self._record(request)
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model",
                                                               "owned_by": self.name}]})

    async def _metrics(self, request: web.Request) -> web.Response:
        """The proxy's health prober reads the KV cache size here as an engine comes into service
        (not recorded: every test's prober asks)."""
        text = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0.0\n"
        if self.kv_blocks is not None:
            text += ("# TYPE vllm:cache_config_info gauge\n"
                     f'vllm:cache_config_info{{block_size="16",engine="0",num_gpu_blocks="{self.kv_blocks}"}} 1.0\n')
        return web.Response(text=text, content_type="text/plain")

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "0.32.0-standin"})

    async def _echo(self, request: web.Request) -> web.Response:
        body = await self._record(request)
        return web.json_response({"echo": body, "path": request.path_qs, "server": self.name},
                                 headers={"X-Stand-In": self.name})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await self._record(request)
        if not isinstance(body, dict):  # as vLLM's request validation answers
            return web.json_response({"error": {"message": "There was an error parsing the body",
                                                "type": "Bad Request", "param": None, "code": 400}}, status=400)
        self.running += 1
        try:
            return await self._answer(request, body)
        except asyncio.CancelledError:
            self.aborted += 1
            raise
        finally:
            self.running -= 1

    async def _answer(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        rid = request.headers.get("X-Request-Id", "")
        if self.hang:
            await asyncio.sleep(3600)
        if self.fail_status is not None:
            return web.json_response({"error": {"message": f"{self.name} failed on purpose", "type": "StandInError",
                                                "param": None, "code": self.fail_status}},
                                     status=self.fail_status)
        if self.fail_on_prompt is not None and body.get("prompt") == self.fail_on_prompt:
            return web.json_response({"error": {"message": "prompt refused", "type": "BadRequestError",
                                                "param": None, "code": 400}}, status=400)
        params = body.get("kv_transfer_params") or {}
        chat = request.path.endswith("/chat/completions")
        tag = f"{body.get('prompt')}:" if self.prompt_text and isinstance(body.get("prompt"), str) else ""
        if params.get("do_remote_decode"):
            kv = None if self.no_kv_params else {
                "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [7, 8],
                "remote_engine_id": f"engine-{self.name}", "remote_request_id": f"cmpl-{rid}",
                "remote_host": "127.0.0.1", "remote_port": 5601, "tp_size": 1}
            return web.json_response({"id": f"cmpl-{rid}", "object": "text_completion", "model": "tiny",
                                      "choices": [self._choice(chat, 0, "tok0 ")],
                                      "kv_transfer_params": kv})
        n = int(body.get("n") or 1)
        if not body.get("stream"):
            text = "".join(f"{tag}tok{i} " for i in range(self.tokens))
            return web.json_response({"id": f"cmpl-{rid}", "object": "chat.completion" if chat else "text_completion",
                                      "model": "tiny", "served_by": self.name,
                                      "choices": [self._choice(chat, i, text) for i in range(n)],
                                      "usage": {"prompt_tokens": 3, "completion_tokens": self.tokens * n,
                                                "total_tokens": 3 + self.tokens * n}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Stand-In": self.name})
        await resp.prepare(request)
        sent = 0
        for t in range(self.tokens):
            for i in range(n):
                if self.die_after is not None and sent >= self.die_after:
                    assert request.transport is not None
                    request.transport.close()
                    return resp
                choice = self._choice(chat, i, f"{tag}tok{t} ", delta=True)
                chunk = {"id": f"cmpl-{rid}", "model": "tiny", "choices": [choice]}
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                sent += 1
            if t == 0 and self.gate is not None:
                await self.gate.wait()
            if self.token_delay:
                await asyncio.sleep(self.token_delay)
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"id": f"cmpl-{rid}", "choices": [], "usage": {"completion_tokens": self.tokens * n}}
            await resp.write(b"data: " + json.dumps(usage, separators=(",", ":")).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def _choice(self, chat: bool, index: int, text: str, delta: bool = False) -> dict[str, Any]:
        if chat:
            key = "delta" if delta else "message"
            return {"index": index, key: {"role": "assistant", "content": text}, "finish_reason": None}
        return {"index": index, "text": text, "finish_reason": None}


#: fast probes, each with a deadline that a test process starved of CPU for a second or two (a
#: loaded CI machine) does not miss: at start one late probe takes an engine out, and a request
#: sent then gets a 503
FAST = ProxyTimeouts(connect=1.0, request=5.0, health_interval=0.1, health_timeout=5.0, drain=1.0)


async def wait_for(predicate: Callable[[], bool], timeout: float = 3.0) -> None:
    """Poll ``predicate`` until true; fail the test after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(0.02)


async def read_events(resp: aiohttp.ClientResponse) -> list[str]:
    """The ``data:`` payloads of an SSE response, in order."""
    events = []
    async for line in resp.content:
        text = line.decode().strip()
        if text.startswith("data:"):
            events.append(text[5:].strip())
    return events
