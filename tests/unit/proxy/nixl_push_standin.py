"""Stand-in vLLM servers with NIXL in push mode (``NixlPushConnector``).

These are stand-ins, not engines: they keep the shape of vLLM 0.32's push protocol
(``kv_connector/v1/nixl/push_scheduler.py``, ``push_worker.py``) for the proxy's push
handoff (disagg/proxy/nixl_push_handoff.py), with faults on demand. Real engines and the
real connector are covered by tests/e2e/test_pd_nixl_push.py.

- A prefill stand-in has a NIXL engine id and a "side channel" on a port of its own
  (``kv_port``). A generation request with ``do_remote_decode`` is computed (``compute_s``),
  then its "blocks" (the prompt) wait, up to ``lease_s``, for a decode registration whose
  request id is the prefill's own (the ``X-Request-Id`` both engines got: vLLM matches
  internal ids less their random suffix, which comes to the same); when one is there,
  the prefill WRITEs the prompt into that decode's side channel. It answers its HTTP
  request when it finished computing, with push mode's ``kv_transfer_params`` (its
  engine id, side channel, ``transfer_mode: push``), whether or not a registration came.
  Registrations that name another engine id are refused (vLLM: the NIXL handshake's
  "engine ID mismatch").
- A decode stand-in, for a request with ``do_remote_prefill``, reads the keys vLLM's
  scheduler reads (a missing one is a 500, where vLLM would raise ``KeyError``), sends
  its registration to ``remote_host:remote_port`` and waits for the WRITE **for ever**,
  as vLLM 0.32 does (its registration watchdog only drops the registration). A refused
  registration (unreachable, wrong engine id) makes it recompute the prompt
  (``kv_load_failure_policy`` recompute). Streamed replies send their headers at once,
  before the KV is there, as vLLM's API server does. Its text is derived from the KV it
  got (or the prompt it recomputed), so KV written for another request shows in the answer.
- Either side counts generation requests it was cancelled in (the proxy closed them)
  and records every body and ``X-Request-Id`` it got.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from proxy_standin import RoleStandIn, engine_app

#: the keys vLLM 0.32's push scheduler reads from a decode request's kv_transfer_params
DECODE_KEYS = ("remote_engine_id", "remote_host", "remote_port", "tp_size", "remote_request_id")


def answer_text(prompt: str, tokens: int) -> list[str]:
    """The tokens a stand-in decode generates from a prompt's KV (or from the prompt itself)."""
    return [f"{prompt}:{i} " for i in range(tokens)]


@dataclass
class PushStandIn(RoleStandIn):
    """One stand-in vLLM server with NixlPushConnector, ``mode`` prefill or decode."""

    engine_id: str = "engine-a"
    compute_s: float = 0.05            # prefill: the prefill's time
    lease_s: float = 3.0               # prefill: how long finished blocks wait for a registration
    hang: bool = False                 # prefill: never answer
    reply_mode: str = "push"           # prefill: transfer_mode it reports (pull: a NixlConnector; none: no params)
    registered: list[float] = field(default_factory=list)  # decode: loop time of each registration sent
    ids_from_header: bool = False      # decode: reply ``id`` cmpl-<X-Request-Id>, as vLLM builds it (else "d")
    written: int = 0                   # prefill: WRITEs issued
    _registrations: dict[str, str] = field(default_factory=dict)            # prefill: request id -> decode side channel
    _matched: dict[str, asyncio.Event] = field(default_factory=dict)        # prefill: request id -> registered
    _kv: dict[str, str] = field(default_factory=dict)                       # decode: request id -> KV written
    _kv_events: dict[str, asyncio.Event] = field(default_factory=dict)      # decode: request id -> WRITE arrived
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def start(self) -> None:
        self.url = f"http://127.0.0.1:{await self._apps.serve(engine_app(self._generate))}"
        channel = web.Application()
        channel.router.add_post("/notify", self._notify)
        self.kv_port = await self._apps.serve(channel)

    async def stop(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await super().stop()

    async def _notify(self, request: web.Request) -> web.Response:
        """The side channel (vLLM: NIXL notifications): on prefill a decode's registration (a
        PUSH_REG, after a handshake that checks the engine id), on decode a WRITE of one request's
        KV and its completion notification."""
        note = await request.json()
        rid = str(note["request_id"])
        if note["kind"] == "register":
            if note["engine_id"] != self.engine_id:
                return web.json_response({"error": f"engine ID mismatch: {self.engine_id}"}, status=409)
            self._registrations[rid] = str(note["decode"])
            self._matched.setdefault(rid, asyncio.Event()).set()
        else:
            self._kv[rid] = str(note["kv"])
            self._kv_events.setdefault(rid, asyncio.Event()).set()
        return web.json_response({"ok": True})

    # generation

    async def _prefill(self, request: web.Request, body: dict[str, Any]) -> web.Response:
        rid = request.headers["X-Request-Id"]
        if self.hang:
            await asyncio.sleep(3600)
        await asyncio.sleep(self.compute_s)
        if self.fail_status is not None:
            return self._error()
        prompt = _prompt(body)
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_decode"):
            task = asyncio.create_task(self._push(rid, prompt))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        self.answered.append(asyncio.get_running_loop().time())
        kv = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2]],
              "remote_engine_id": self.engine_id, "remote_request_id": f"cmpl-{rid}-0-1234abcd",
              "remote_host": "127.0.0.1", "remote_port": self.kv_port, "tp_size": 1, "dcp_size": 1,
              "pp_size": 1, "remote_num_tokens": 5, "transfer_mode": self.reply_mode}
        return web.json_response({"id": "p", "object": "text_completion", "model": "tiny",
                                  "choices": [{"index": 0, "text": "x ", "finish_reason": "length"}],
                                  "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
                                  "kv_transfer_params": None if self.reply_mode == "none" else kv})

    async def _push(self, rid: str, prompt: str) -> None:
        """The finished blocks wait for their registration up to the lease, then are written."""
        event = self._matched.setdefault(rid, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), self.lease_s)
        except TimeoutError:
            return
        self.written += 1
        async with aiohttp.ClientSession() as session, \
                session.post(self._registrations[rid] + "/notify",
                             json={"kind": "write", "request_id": rid, "kv": prompt}) as r:
            r.raise_for_status()

    async def _decode(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        if self.fail_status is not None:
            return self._error()
        params = body.get("kv_transfer_params")
        out: web.StreamResponse | None = None
        stream = bool(body.get("stream"))
        if stream:
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)                         # vLLM: headers before the KV is there
        kv = _prompt(body)
        if params and params.get("do_remote_prefill"):
            missing = [k for k in DECODE_KEYS if k not in params]
            if missing:
                raise web.HTTPInternalServerError(text=f"KeyError: {missing}")
            rid = request.headers["X-Request-Id"]
            event = self._kv_events.setdefault(rid, asyncio.Event())
            reg = {"kind": "register", "request_id": rid, "engine_id": params["remote_engine_id"],
                   "decode": f"http://127.0.0.1:{self.kv_port}"}
            try:
                async with aiohttp.ClientSession() as session, session.post(
                        f"http://{params['remote_host']}:{params['remote_port']}/notify", json=reg) as r:
                    accepted = r.status == 200
            except aiohttp.ClientError:
                accepted = False
            self.registered.append(asyncio.get_running_loop().time())
            if accepted:
                await event.wait()                             # for ever, as vLLM 0.32's push mode
                kv = self._kv[rid]
            else:
                self.recomputed += 1
        reply_id = f"cmpl-{request.headers['X-Request-Id']}" if self.ids_from_header else "d"
        return await self._reply(answer_text(kv, self.tokens), out, reply_id)


def _prompt(body: dict[str, Any]) -> str:
    if "messages" in body:
        return str(body["messages"][-1]["content"])
    return str(body.get("prompt"))
