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
  proxy's fallback), or any request to a ``local_hit`` decode (its own prefix
  cache holds every prompt), is generated directly.
- Either side counts generation requests it was cancelled in (the proxy
  closed them) and records every body it got.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from proxy_standin import RoleStandIn, engine_app

#: longest wait of a stand-in for its peer (a test that reaches it failed)
PEER_WAIT_S = 3.0


@dataclass
class StreamStandIn(RoleStandIn):
    """One stand-in vLLM server in ``mode`` prefill or decode."""

    fail_early: bool = False           # prefill: fail at once, before any decode connected
    fail_delay: float = 0.0            # seconds before failing (prefill: after decode connected)
    hang: bool = False                 # prefill: never answer once decode connected
    delay: float = 0.0                 # decode: seconds before doing anything with a request
    early_headers: bool = False        # decode: send stream headers before the KV arrived
    local_hit: bool = False            # decode: its own prefix cache holds the prompt: never connects
    recompute_s: float = 0.3           # decode: how long recomputing a prompt takes
    headers_sent: int = 0
    connected: dict[str, asyncio.Event] = field(default_factory=dict)    # prefill: keys a decode claimed
    outcome: dict[str, str] = field(default_factory=dict)                # prefill: key -> done | failed

    async def start(self) -> None:
        self.url = f"http://127.0.0.1:{await self._apps.serve(engine_app(self._generate))}"
        if self.mode == "prefill":
            listener = web.Application()
            listener.router.add_post("/connect", self._connect)
            listener.router.add_get("/status", self._status)
            self.kv_port = await self._apps.serve(listener)

    def generations(self) -> list[dict[str, Any]]:
        return self.received

    # the KV listener (prefill)

    def _key_event(self, key: str) -> asyncio.Event:
        return self.connected.setdefault(key, asyncio.Event())

    async def _connect(self, request: web.Request) -> web.Response:
        self._key_event(str((await request.json())["key"])).set()
        return web.json_response({"ok": True})

    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response({"state": self.outcome.get(request.query["key"], "pending")})

    # generation

    async def _prefill(self, request: web.Request, body: dict[str, Any]) -> web.Response:
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
        if params and not self.local_hit:
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
            return await self._reply(text, None)
        return await self._reply(text, out or await self._headers(request))

    async def _headers(self, request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        self.headers_sent += 1
        return out
