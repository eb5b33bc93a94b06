"""Prefill -> decode handoff protocols, one class per engine family.

The proxy calls :meth:`Handoff.serve` once per ``split`` route (one prompt of a
client request: :mod:`disagg.proxy.routes`) when it has a prefill pool. A
handoff decides what prefill and decode receive and in which order; the
proxy relays the decode reply it yields, falls back to decode alone when it
raises :class:`PrefillFailed`, and turns any other error into the client's error.

- :class:`VllmHandoff` (sequential, NixlConnector pull mode): prefill with
  ``max_tokens: 1`` and ``kv_transfer_params.do_remote_decode``, then decode
  with the client's request plus the ``kv_transfer_params`` prefill returned.
- A concurrent protocol (SGLang: the same body with ``bootstrap_room`` sent to
  prefill and decode at once; for vLLM, the machinery of
  :mod:`disagg.proxy.concurrent_handoff` serves the socket connector's streaming
  mode, :mod:`disagg.proxy.socket_stream_handoff`, and NIXL's push mode,
  :mod:`disagg.proxy.nixl_push_handoff`) fits the same interface: its
  ``serve`` starts both requests, yields the decode reply with ``companion``
  set to the prefill task, and cancels whichever side is left if the other
  fails. Add it to :data:`HANDOFFS`.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

import aiohttp

from disagg.errors import ProxyError
from disagg.proxy.backends import Backend, BackendPool
from disagg.proxy.errors import ProxyHTTPError, UpstreamError
from disagg.proxy.metrics import ProxyMetrics
from disagg.proxy.routes import CHAT, COMPLETIONS, GenerationRequest, PromptRoute
from disagg.proxy.upstream import Upstream
from disagg.serving import LMCACHE_HANDOFF, NIXL_PUSH_HANDOFF, SGLANG_HANDOFF, STREAMING_HANDOFF, VLLM_HANDOFF

__all__ = [
    "CHAT",
    "COMPLETIONS",
    "HANDOFFS",
    "DecodeReply",
    "EngineErrorReply",
    "GenerationRequest",
    "Handoff",
    "PrefillFailed",
    "VllmHandoff",
    "handoff_class",
]

@dataclass
class DecodeReply:
    """The reply the client gets: decode's response, headers read, body not yet."""

    backend: Backend
    response: aiohttp.ClientResponse
    #: perf_counter when prefill answered (None: no prefill, or concurrent)
    prefill_done: float | None = None
    #: concurrent protocols: the prefill request still running; the proxy
    #: settles it after the decode body (:meth:`settle`) and cancels it if the client leaves
    companion: asyncio.Task[None] | None = field(default=None)
    #: what the handoff appended to the request id the engines saw (vLLM builds a reply's ``id``
    #: from ``X-Request-Id``); the relay removes it from the reply, so the client gets the id a
    #: colocated server would give (NIXL push's fresh ``-push<16 hex>``)
    id_suffix: str = ""
    #: called by :meth:`settle` before it awaits the companion: decode's reply is complete, so a
    #: prefill that has not answered yet can do nothing for it (decode recomputed what it did not
    #: receive: the socket stream); the handoff cancels such a prefill request (the companion then
    #: ends without raising) and lets one that answered finish
    release_companion: Callable[[], None] | None = None

    async def settle(self) -> None:
        """Called by the proxy once decode's body was relayed whole: release the companion
        (:attr:`release_companion`), then wait for it."""
        if self.companion is None:
            return
        if self.release_companion is not None:
            self.release_companion()
        await self.companion


class PrefillFailed(ProxyError):
    """Prefill could not be used; the request may still be served by decode alone.

    ``reason`` is a short metric label (connect, timeout, status, ...).
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


class EngineErrorReply(ProxyError):
    """An engine answered with an error the client must see unchanged
    (e.g. prefill rejecting a bad request with 400)."""

    def __init__(self, url: str, status: int, body: bytes, headers: Mapping[str, str]) -> None:
        super().__init__(f"{url} answered {status}")
        self.status = status
        self.body = body
        self.headers = headers


class Handoff(ABC):
    """The P->D protocol of one engine family.

    Built once per app with the pools, the upstream client and the metrics;
    must not change the pools' membership except through ``mark_down``.
    """

    #: the ``--handoff`` value this protocol serves
    kind: ClassVar[str]
    #: whether a decode engine of this family can serve a request alone
    #: (``local`` routes, fallback); if not, every route goes through :meth:`serve`
    serves_local: ClassVar[bool] = True

    def __init__(self, upstream: Upstream, prefill: BackendPool, decode: BackendPool,
                 metrics: ProxyMetrics, options: Mapping[str, str] | None = None) -> None:
        self.upstream = upstream
        self.prefill = prefill
        self.decode = decode
        self.metrics = metrics
        #: the proxy's ``--handoff-option`` settings (engine-specific)
        self.options: Mapping[str, str] = dict(options or {})

    async def aclose(self) -> None:  # noqa: B027 (optional hook, most handoffs hold nothing)
        """Release what the handoff holds beyond requests (sockets); the proxy calls it on shutdown."""

    @abstractmethod
    def serve(self, route: PromptRoute) -> AbstractAsyncContextManager[DecodeReply]:
        """Run the handoff for one route (``route.request``: one prompt); yield decode's reply
        while the proxy relays it.

        Called by the proxy once per ``split`` route, concurrently for many
        routes; uses the engines the routing policy preset in ``route.prefill`` /
        ``route.decode`` while they are healthy (else its own pick) and records
        the engines it used there
        (and the prompt's ``route.kv_transfer_params`` where the protocol has
        them). Raises :class:`PrefillFailed` before anything reached decode
        when prefill is unusable (the proxy then applies its fallback policy),
        :class:`EngineErrorReply` to hand an engine's 4xx to the client, and
        :class:`~disagg.proxy.errors.ProxyHTTPError` for decode failures. On
        exit (normal, error or cancellation) it must release every backend
        lease and close any unfinished engine request.
        """


class VllmHandoff(Handoff):
    """vLLM with NixlConnector (pull mode): prefill first, then decode."""

    kind = VLLM_HANDOFF

    #: kv_transfer_params sent to prefill (vLLM's NixlConnector pull protocol; docs/proxy.md)
    PREFILL_KV_PARAMS: ClassVar[dict[str, Any]] = {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None}

    @staticmethod
    def prefill_body(endpoint: str, body: Mapping[str, Any],
                     kv_transfer_params: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """What prefill receives: the client's request computing one token, not streamed.

        ``n`` is 1: the prompt's KV is the same for every sample, and extra
        samples would each pin prefill blocks that no decode ever pulls.
        ``kv_transfer_params`` replaces NIXL's (other connectors' handoffs).
        """
        out = dict(body)
        for key in ("stream_options", "min_tokens"):
            out.pop(key, None)
        out["stream"] = False
        out["max_tokens"] = 1
        if endpoint == CHAT:
            out["max_completion_tokens"] = 1
        if "n" in out:
            out["n"] = 1
        out["kv_transfer_params"] = dict(VllmHandoff.PREFILL_KV_PARAMS if kv_transfer_params is None
                                         else kv_transfer_params)
        return out

    @staticmethod
    def decode_body(body: Mapping[str, Any], kv_transfer_params: Mapping[str, Any]) -> dict[str, Any]:
        """What decode receives: the client's request plus prefill's ``kv_transfer_params``."""
        out = dict(body)
        out["kv_transfer_params"] = dict(kv_transfer_params)
        return out

    def prefill_answered(self, route: PromptRoute, backend: Backend, elapsed: float, reply: Mapping[str, Any]) -> None:
        """Prefill ``backend`` answered ``route`` with ``reply`` (a JSON object) after ``elapsed`` seconds:
        the ``prefill_seconds`` metric and the route's learner (:meth:`PromptRoute.prefill_answered
        <disagg.proxy.routes.PromptRoute.prefill_answered>`, with the prompt tokens it counted) learn it."""
        self.metrics.prefill.observe(elapsed)
        usage = reply.get("usage")
        counted = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        route.prefill_answered(backend, elapsed, counted if type(counted) is int else None)

    async def read_prefill_reply(self, backend: Backend, resp: aiohttp.ClientResponse) -> dict[str, Any]:
        """Prefill ``backend``'s reply ``resp`` (headers read) as a JSON object; a 4xx is the client's
        (:class:`EngineErrorReply`), any other status but 200 a :class:`PrefillFailed`; an unreadable
        body raises :class:`~disagg.proxy.errors.UpstreamError`. :meth:`run_prefill`, and the
        concurrent handoffs' prefill step."""
        if 400 <= resp.status < 500:
            body = await self.upstream.read(backend, resp)
            raise EngineErrorReply(backend.url, resp.status, body, resp.headers)
        if resp.status != 200:
            body = await self.upstream.read(backend, resp)
            raise PrefillFailed("status", f"prefill {backend.url} answered {resp.status}: "
                                f"{body[:300].decode(errors='replace')}")
        return await self.upstream.read_json(backend, resp)

    async def run_prefill(self, route: PromptRoute, kv_transfer_params: Mapping[str, Any] | None = None,
                          headers: Mapping[str, str] | None = None) -> dict[str, Any]:
        """Prefill ``route``'s prompt on its preset prefill backend if healthy, else the best one
        (recorded in ``route.prefill``); returns the ``kv_transfer_params`` it answered and tells
        the route's learner how long it took. ``headers`` replace the request's own (another
        ``X-Request-Id``: :mod:`disagg.proxy.nixl_push_handoff`).

        Raises :class:`PrefillFailed` (fallback possible) or :class:`EngineErrorReply`.
        """
        req = route.request
        data = json.dumps(self.prefill_body(req.endpoint, req.body, kv_transfer_params)).encode()
        started = time.perf_counter()
        try:
            async with self.upstream.request(self.prefill, "POST", req.endpoint, data=data,
                                             headers=req.headers if headers is None else headers,
                                             prefer=route.prefill) as (backend, resp):
                route.prefill = backend
                reply = await self.read_prefill_reply(backend, resp)
        except UpstreamError as exc:
            raise PrefillFailed(exc.kind, f"prefill {exc.message}") from exc
        except ProxyHTTPError as exc:  # no healthy prefill instance
            raise PrefillFailed("no_healthy_prefill", exc.message) from exc
        self.prefill_answered(route, backend, time.perf_counter() - started, reply)
        params = reply.get("kv_transfer_params")
        if not isinstance(params, dict) or not params:
            raise PrefillFailed("no_kv_params", f"prefill {backend.url} answered without kv_transfer_params "
                                "(is it started with a kv_producer --kv-transfer-config?)")
        return params

    def serve(self, route: PromptRoute) -> AbstractAsyncContextManager[DecodeReply]:
        """Prefill, then decode with the ``kv_transfer_params`` this prompt's prefill returned."""
        return self.serve_in_turn(route)

    @asynccontextmanager
    async def serve_in_turn(self, route: PromptRoute, kv_transfer_params: Mapping[str, Any] | None = None,
                            headers: Mapping[str, str] | None = None) -> AsyncIterator[DecodeReply]:
        """Prefill (with ``kv_transfer_params``, default NIXL pull's), then decode with the
        ``kv_transfer_params`` prefill returned; both with ``headers`` (default the request's).
        :meth:`serve`, and the push handoff while it does not know a prefill engine yet."""
        req = route.request
        params = await self.run_prefill(route, kv_transfer_params, headers)
        route.kv_transfer_params = params
        prefill_done = time.perf_counter()
        data = json.dumps(self.decode_body(req.body, params)).encode()
        async with self.upstream.request(self.decode, "POST", req.endpoint, data=data,
                                         headers=req.headers if headers is None else headers,
                                         prefer=route.decode) as (backend, resp):
            route.decode = backend
            yield DecodeReply(backend, resp, prefill_done=prefill_done)


#: ``--handoff`` value -> "module:Class" of its handoff (imported on use)
HANDOFFS: dict[str, str] = {
    VLLM_HANDOFF: "disagg.proxy.handoff:VllmHandoff",
    SGLANG_HANDOFF: "disagg.proxy.sglang_handoff:SglangHandoff",
    LMCACHE_HANDOFF: "disagg.proxy.lmcache_handoff:LmcacheHandoff",
    STREAMING_HANDOFF: "disagg.proxy.socket_stream_handoff:SocketStreamHandoff",
    NIXL_PUSH_HANDOFF: "disagg.proxy.nixl_push_handoff:NixlPushHandoff",
}


def handoff_class(engine: str) -> type[Handoff]:
    """The handoff class for an engine family; raises :class:`ProxyError` if unknown."""
    try:
        target = HANDOFFS[engine]
    except KeyError:
        raise ProxyError(f"engine {engine!r} has no proxy handoff yet; known: {', '.join(HANDOFFS)}") from None
    module, _, attr = target.partition(":")
    # an import by name (the handoff modules import this one): the table above names Handoff subclasses
    return cast("type[Handoff]", getattr(importlib.import_module(module), attr))
