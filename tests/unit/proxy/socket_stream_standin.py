"""Stand-in vLLM servers with the socket connector in streaming mode.

These are stand-ins, not engines: they keep the protocol's shape for the
proxy's streaming socket handoff (disagg/proxy/socket_stream_handoff.py),
with faults on demand. Real engines and the real connector are covered by
tests/e2e.

- A prefill stand-in runs a "KV listener" on a port of its own (the
  connector's ``host:kv_port``). A request's KV is computed only once a decode
  stand-in connected there with the request's ``stream_key`` (so a proxy that
  waited for prefill before sending decode its request would make prefill
  fail); then the key is marked done (or failed) and prefill answers.
- A decode stand-in connects to ``remote_host:remote_port`` from its
  ``kv_transfer_params`` with the key, then waits until the key is done and
  generates. If the listener cannot be reached or the transfer failed, it
  recomputes the prompt itself (``kv_load_failure_policy`` recompute) and
  generates the same tokens. A request without ``kv_transfer_params`` (the
  proxy's fallback) is generated directly.
- Either side counts generation requests it was cancelled in (the proxy
  closed them) and records every body it got.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

#: longest wait of a stand-in for its peer (a test that reaches it failed)
PEER_WAIT_S = 3.0


@dataclass
class StreamStandIn:
    """One stand-in vLLM server in ``mode`` prefill or decode."""

    mode: str
    tokens: int = 3
    fail_status: int | None = None     # answer generation with this status
    fail_early: bool = False           # prefill: fail at once, before any decode connected
    fail_delay: float = 0.0            # seconds before failing (prefill: after decode connected)
    hang: bool = False                 # prefill: never answer once decode connected
    delay: float = 0.0                 # decode: seconds before doing anything with a request
    early_headers: bool = False        # decode: send stream headers before the KV arrived
    recompute_s: float = 0.3           # decode: how long recomputing a prompt takes
    received: list[dict[str, Any]] = field(default_factory=list)
    arrived: list[float] = field(default_factory=list)    # loop time of each generation request
    answered: list[float] = field(default_factory=list)   # prefill: loop time of each answer
    recomputed: int = 0
    headers_sent: int = 0
    aborted: int = 0
    running: int = 0
    url: str = ""
    kv_port: int = 0
    connected: dict[str, asyncio.Event] = field(default_factory=dict)    # prefill: keys a decode claimed
    outcome: dict[str, str] = field(default_factory=dict)                # prefill: key -> done | failed
    _runners: list[web.AppRunner] = field(default_factory=list)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        self.url = f"http://127.0.0.1:{await self._serve(app)}"
        if self.mode == "prefill":
            listener = web.Application()
            listener.router.add_post("/connect", self._connect)
            listener.router.add_get("/status", self._status)
            self.kv_port = await self._serve(listener)

    async def _serve(self, app: web.Application) -> int:
        runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.5)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        self._runners.append(runner)
        return int(runner.addresses[0][1])

    async def stop(self) -> None:
        for runner in self._runners:
            await runner.cleanup()
        self._runners.clear()

    def generations(self) -> list[dict[str, Any]]:
        return self.received

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    # the KV listener (prefill)

    def _key_event(self, key: str) -> asyncio.Event:
        return self.connected.setdefault(key, asyncio.Event())

    async def _connect(self, request: web.Request) -> web.Response:
        self._key_event(str((await request.json())["key"])).set()
        return web.json_response({"ok": True})

    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response({"state": self.outcome.get(request.query["key"], "pending")})

    # generation

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
        self.arrived.append(asyncio.get_running_loop().time())
        self.running += 1
        try:
            if self.mode == "prefill":
                return await self._prefill(body)
            return await self._decode(request, body)
        except asyncio.CancelledError:
            self.aborted += 1
            raise
        finally:
            self.running -= 1

    def _error(self) -> web.Response:
        return web.json_response({"error": {"message": f"stand-in {self.mode} failed on purpose",
                                            "type": "StandInError", "param": None, "code": self.fail_status}},
                                 status=self.fail_status or 500)

    async def _prefill(self, body: dict[str, Any]) -> web.Response:
        key = str(body["kv_transfer_params"]["stream_key"])
        if self.fail_status is not None and self.fail_early:
            self.outcome[key] = "failed"
            return self._error()
        try:
            await asyncio.wait_for(self._key_event(key).wait(), PEER_WAIT_S)
        except TimeoutError:
            self.outcome[key] = "failed"
            return web.json_response({"error": {"message": "no decode connected"}}, status=500)
        if self.hang:
            await asyncio.sleep(3600)
        if self.fail_status is not None:
            await asyncio.sleep(self.fail_delay)
            self.outcome[key] = "failed"
            return self._error()
        self.outcome[key] = "done"
        self.answered.append(asyncio.get_running_loop().time())
        return web.json_response({"id": "p", "object": "text_completion", "model": "tiny",
                                  "choices": [{"index": 0, "text": "tok0 ", "finish_reason": "length"}],
                                  "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
                                  "kv_transfer_params": None})

    async def _decode(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        await asyncio.sleep(self.delay)
        if self.fail_status is not None:
            await asyncio.sleep(self.fail_delay)
            return self._error()
        params = body.get("kv_transfer_params")
        out: web.StreamResponse | None = None
        if params:
            listener = f"http://{params['remote_host']}:{params['remote_port']}"
            key = params["stream_key"]
            async with aiohttp.ClientSession() as session:
                try:
                    async with session.post(f"{listener}/connect", json={"key": key}) as r:
                        r.raise_for_status()
                except aiohttp.ClientError:
                    state = "failed"
                else:
                    if self.early_headers and body.get("stream"):
                        out = await self._headers(request)
                    state = "pending"
                    while state == "pending":              # the KV arriving, layer by layer
                        await asyncio.sleep(0.01)
                        async with session.get(f"{listener}/status", params={"key": key}) as r:
                            state = (await r.json())["state"]
            if state != "done":
                self.recomputed += 1
                await asyncio.sleep(self.recompute_s)
        text = [f"tok{i} " for i in range(self.tokens)]
        if not body.get("stream"):
            return web.json_response({"id": "d", "object": "text_completion", "model": "tiny", "served_by": "decode",
                                      "choices": [{"index": 0, "text": "".join(text), "finish_reason": "length"}],
                                      "usage": {"prompt_tokens": 5, "completion_tokens": self.tokens,
                                                "total_tokens": 5 + self.tokens}})
        if out is None:
            out = await self._headers(request)
        for t in text:
            event = {"id": "d", "model": "tiny", "choices": [{"index": 0, "text": t, "finish_reason": None}]}
            await out.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    async def _headers(self, request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        self.headers_sent += 1
        return out
