"""Stand-in SGLang prefill/decode servers that follow SGLang's bootstrap semantics.

These are stand-ins, not engines: SGLang's P/D mode needs a GPU, so the SGLang
handoff is tested against them. They keep the protocol's shape:

- a prefill stand-in runs a bootstrap server on its own port (SGLang's
  ``--disaggregation-bootstrap-port``); a request's KV is "computed" only
  after the decode stand-in registered the request's ``bootstrap_room`` there,
  then the room is marked transferred and prefill answers;
- a decode stand-in registers the room with ``bootstrap_host:bootstrap_port``
  from the request body, waits until the room is transferred, then generates;
- either side counts requests it was cancelled in (the proxy closed them).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from proxy_standin import ServedApps, engine_app

#: longest wait of a stand-in for its peer (a test that reaches it failed)
PEER_WAIT_S = 5.0


@dataclass
class SglangStandIn:
    """One stand-in SGLang server in ``mode`` prefill or decode."""

    mode: str
    tokens: int = 3
    fail_status: int | None = None      # answer generation with this status (after registration for prefill)
    fail_delay: float = 0.0             # wait this long before failing
    early_headers: bool = False         # decode: send stream headers before the KV arrived
    received: list[dict[str, Any]] = field(default_factory=list)
    aborted: int = 0
    running: int = 0
    url: str = ""
    bootstrap_port: int = 0
    rooms: dict[int, asyncio.Event] = field(default_factory=dict)     # prefill: registered rooms
    transferred: dict[int, asyncio.Event] = field(default_factory=dict)
    _apps: ServedApps = field(default_factory=ServedApps)

    async def start(self) -> None:
        self.url = f"http://127.0.0.1:{await self._apps.serve(engine_app(self._generate))}"
        if self.mode == "prefill":
            boot = web.Application()
            boot.router.add_post("/register", self._register)
            boot.router.add_get("/status", self._status)
            self.bootstrap_port = await self._apps.serve(boot)

    async def stop(self) -> None:
        await self._apps.stop()

    def _room_events(self, room: int) -> tuple[asyncio.Event, asyncio.Event]:
        return self.rooms.setdefault(room, asyncio.Event()), self.transferred.setdefault(room, asyncio.Event())

    async def _register(self, request: web.Request) -> web.Response:
        registered, _ = self._room_events(int((await request.json())["room"]))
        registered.set()
        return web.json_response({"ok": True})

    async def _status(self, request: web.Request) -> web.Response:
        _, done = self._room_events(int(request.query["room"]))
        return web.json_response({"transferred": done.is_set()})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
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
        return web.json_response({"object": "error", "message": f"stand-in {self.mode} failed on purpose",
                                  "code": self.fail_status}, status=self.fail_status or 500)

    async def _prefill(self, body: dict[str, Any]) -> web.Response:
        registered, done = self._room_events(int(body["bootstrap_room"]))
        await asyncio.wait_for(registered.wait(), PEER_WAIT_S)     # decode must have registered
        if self.fail_status is not None:
            await asyncio.sleep(self.fail_delay)
            return self._error()
        done.set()
        reply = {"id": "p", "object": "text_completion", "choices": [{"text": "t0"}],
                 "meta_info": {"input_token_logprobs": [[-1.0, 11], [-2.0, 12]]}}
        if body.get("stream"):   # SGLang streams prefill's one event too
            return web.Response(body=b"data: " + json.dumps(reply).encode() + b"\n\ndata: [DONE]\n\n",
                                content_type="text/event-stream")
        return web.json_response(reply)

    async def _decode(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        if self.fail_status is not None:
            await asyncio.sleep(self.fail_delay)
            return self._error()
        boot = f"http://{body['bootstrap_host']}:{body['bootstrap_port']}"
        room = int(body["bootstrap_room"])
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{boot}/register", json={"room": room}) as r:
                r.raise_for_status()
            out: web.StreamResponse | None = None
            if self.early_headers and body.get("stream"):
                out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await out.prepare(request)
            while True:                                  # wait for the KV, as decode polls its transfer
                async with session.get(f"{boot}/status", params={"room": str(room)}) as r:
                    if (await r.json())["transferred"]:
                        break
                await asyncio.sleep(0.01)
        meta = {"input_token_logprobs": [[None, 13]]}
        if not body.get("stream"):
            text = " ".join(f"tok{i}" for i in range(self.tokens))
            return web.json_response({"id": "d", "object": "text_completion", "served_by": "decode",
                                      "choices": [{"index": 0, "text": text}], "meta_info": meta})
        if out is None:
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
        for i in range(self.tokens):
            event = {"id": "d", "choices": [{"index": 0, "text": f"tok{i}"}], "meta_info": meta}
            await out.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out
