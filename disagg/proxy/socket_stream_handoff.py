"""vLLM with our socket KV connector in streaming mode: prefill and decode at once.

The proxy (:func:`disagg.proxy.app._open_reply`) calls :meth:`SocketStreamHandoff.serve`
once per ``split`` route when it runs with ``--handoff vllm-socket-stream``;
``disagg up`` chooses it for vLLM topologies with
``connector: {type: socket, streaming: true}`` (:mod:`disagg.launch.frontend`).

Protocol, per route: a fresh random transfer key ``K`` (:func:`new_stream_key`)
joins the two requests, which are sent at the same time.

- Prefill (P) gets :meth:`VllmHandoff.prefill_body` (one token, not streamed,
  ``n: 1``) with ``kv_transfer_params = {"do_remote_decode": true,
  "do_remote_prefill": false, "stream_key": K}``. Its reply is read and
  dropped (its time and prompt token count go to the routing's observer and
  ``prefill_seconds``, as for :class:`VllmHandoff`).
- Decode (D) gets the client's request with ``kv_transfer_params =
  {"do_remote_prefill": true, "do_remote_decode": false, "transfer": "socket",
  "stream_key": K, "remote_host": H, "remote_port": PORT}``, ``H:PORT`` being
  the KV listener of the prefill instance chosen for the route (TP rank 0's).
  D's connector connects there with ``K`` and receives each layer's KV while
  P is still computing. The client gets D's reply.

Failure behaviour (D's connector recomputes a prompt whose KV it cannot get:
``kv_load_failure_policy`` recompute, so D's answer is always correct, and the
client only ever gets one engine's answer):

- P answers 4xx before D's response headers arrived: the client gets P's
  status and body unchanged (:class:`EngineErrorReply`); D's request is closed.
- P fails otherwise before D's headers arrived (connection refused: P is
  taken out; 5xx; timeout; broken reply): D's request is closed and
  :class:`PrefillFailed` lets the proxy's fallback serve the prompt on decode
  alone (or answer 503 with ``--fallback never``). No healthy prefill
  instance: the same, before anything is sent.
- P fails after D answered: a warning; D goes on (it recomputes what it did
  not receive) and is never closed for it.
- D answers an error status: relayed unchanged, and P's request is closed. D
  refusing the connection: it is taken out and the next healthy decode
  instance gets the same request (the key lets any decode engine connect).
- On exit (normal, error, the client leaving) both engine requests are closed
  if unfinished, and every lease is released. The prefill request is the
  reply's ``companion``: the proxy awaits it after relaying D's reply.

Option (``--handoff-option``): ``kv_peers=H1:P1,H2:P2``, the KV listener of each
``--prefill`` URL, in the same order (IPv6 as ``[addr]:port``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import ExitStack, asynccontextmanager, suppress
from dataclasses import dataclass
from typing import Any

import aiohttp

from disagg.errors import ProxyError
from disagg.proxy.backends import Backend, BackendPool
from disagg.proxy.errors import NoHealthyBackend, UpstreamConnectError, UpstreamError
from disagg.proxy.handoff import DecodeReply, EngineErrorReply, PrefillFailed, VllmHandoff
from disagg.proxy.metrics import ProxyMetrics
from disagg.proxy.routes import PromptRoute
from disagg.proxy.upstream import Upstream, finish

log = logging.getLogger("disagg.proxy")

#: the ``kv_transfer_params`` field naming a streamed transfer (prefill's and decode's)
STREAM_KEY = "stream_key"
#: ``transfer`` in decode's ``kv_transfer_params``: the socket connector's name for its transfers
TRANSFER = "socket"
#: the handoff option listing each prefill instance's KV listener
KV_PEERS = "kv_peers"

_HOST_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?")
_PORT_RE = re.compile(r"[0-9]{1,5}")


def new_stream_key() -> str:
    """A fresh transfer key for one route (192 random bits, URL-safe text)."""
    return secrets.token_urlsafe(24)


@dataclass(frozen=True)
class KvPeer:
    """One prefill instance's KV listener (TP rank 0's)."""

    host: str
    port: int


def parse_kv_peers(prefill_urls: tuple[str, ...], option: str | None) -> dict[str, KvPeer]:
    """Prefill URL -> :class:`KvPeer` from ``kv_peers=H1:P1,H2:P2`` (one per URL, in order)."""
    usage = ("--handoff-option kv_peers=HOST:PORT,... (each --prefill URL's KV listener, in order; "
             "IPv6 as [ADDR]:PORT)")
    if not option:
        raise ProxyError(f"handoff vllm-socket-stream needs the prefill instances' KV listeners: {usage}")
    peers = [_kv_peer(entry, option, usage) for entry in option.split(",")]
    if len(peers) != len(prefill_urls):
        raise ProxyError(f"kv_peers={option!r} has {len(peers)} entries for {len(prefill_urls)} prefill URLs "
                         "(each prefill instance has its own listener); expected " + usage)
    seen = {p for i, p in enumerate(peers) if p in peers[:i]}
    if seen:
        dup = next(iter(seen))
        raise ProxyError(f"kv_peers={option!r} names {dup.host}:{dup.port} twice (each prefill instance has "
                         "its own listener)")
    return dict(zip(prefill_urls, peers, strict=True))


def _kv_peer(entry: str, option: str, usage: str) -> KvPeer:
    bad = f"kv_peers={option!r}: entry {entry!r}"
    bracketed = entry.startswith("[")
    host, sep, port = entry[1:].partition("]:") if bracketed else entry.rpartition(":")
    if not sep:
        raise ProxyError(f"{bad}: expected HOST:PORT or [IPV6]:PORT; {usage}")
    if bracketed:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ProxyError(f"{bad}: {host!r} in brackets is not an IPv6 address; {usage}") from None
    elif ":" in host:
        raise ProxyError(f"{bad}: an IPv6 address goes in brackets, [ADDR]:PORT")
    elif not _HOST_RE.fullmatch(host):
        raise ProxyError(f"{bad}: expected HOST:PORT with a host name or IPv4 address; {usage}")
    if not _PORT_RE.fullmatch(port) or not 0 < int(port) < 65536:
        raise ProxyError(f"{bad}: expected a port number in 1..65535 after the ':'; {usage}")
    return KvPeer(host, int(port))


class SocketStreamHandoff(VllmHandoff):
    """vLLM with the socket connector streaming KV: prefill and decode in parallel, joined by a key."""

    kind = "vllm-socket-stream"

    def __init__(self, upstream: Upstream, prefill: BackendPool, decode: BackendPool,
                 metrics: ProxyMetrics, options: Mapping[str, str] | None = None) -> None:
        super().__init__(upstream, prefill, decode, metrics, options)
        self.peers = parse_kv_peers(tuple(b.url for b in prefill.backends), self.options.get(KV_PEERS))

    @staticmethod
    def prefill_params(key: str) -> dict[str, Any]:
        """The ``kv_transfer_params`` prefill receives."""
        return {"do_remote_decode": True, "do_remote_prefill": False, STREAM_KEY: key}

    @staticmethod
    def decode_params(key: str, peer: KvPeer) -> dict[str, Any]:
        """The ``kv_transfer_params`` decode receives: where to fetch the KV, and the key."""
        return {"do_remote_prefill": True, "do_remote_decode": False, "transfer": TRANSFER, STREAM_KEY: key,
                "remote_host": peer.host, "remote_port": peer.port}

    @asynccontextmanager
    async def serve(self, route: PromptRoute) -> AsyncIterator[DecodeReply]:
        """Send prefill and decode their requests at once; yield decode's reply."""
        req = route.request
        p_backend = _pick(self.prefill, route.prefill)
        if p_backend is None:
            raise PrefillFailed("no_healthy_prefill", f"no healthy prefill instance: {self.prefill.describe()}")
        d_backend = _pick(self.decode, route.decode)
        if d_backend is None:
            raise NoHealthyBackend(f"no healthy decode instance: {self.decode.describe()}")
        route.prefill, route.decode = p_backend, d_backend
        key = new_stream_key()
        d_params = self.decode_params(key, self.peers[p_backend.url])
        route.kv_transfer_params = d_params
        p_data = json.dumps(self.prefill_body(req.endpoint, req.body, self.prefill_params(key))).encode()
        d_data = json.dumps(self.decode_body(req.body, d_params)).encode()
        with ExitStack() as leases:
            p_task = asyncio.create_task(self._prefill(route, p_backend, p_data))
            d_task = asyncio.create_task(self._decode(route, d_data, leases))
            watcher: asyncio.Task[None] | None = None
            try:
                await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_COMPLETED)
                answered = d_task.done() and not d_task.cancelled() and d_task.exception() is None
                if not answered and p_task.done():   # prefill ended before decode's headers arrived
                    failure = p_task.exception()     # if it failed, the finally closes decode's request
                    if isinstance(failure, UpstreamError):
                        raise PrefillFailed(failure.kind, f"prefill {failure.message}") from failure
                    if failure is not None:          # PrefillFailed (5xx), EngineErrorReply (4xx: the client's)
                        raise failure
                d_used, resp = await d_task
                if resp.status != 200:
                    yield DecodeReply(d_used, resp)       # decode's own error, as it answered
                    return
                watcher = asyncio.create_task(self._watch(p_task, route))
                yield DecodeReply(d_used, resp, companion=watcher)
            finally:
                await _close(watcher, p_task, d_task)   # and closes decode's response if unfinished

    async def _prefill(self, route: PromptRoute, backend: Backend, data: bytes) -> None:
        """Prefill's request; its reply is read and dropped. Raises on any failure. The prefill engine
        counts the request in flight only while it runs (not for the decode's whole reply)."""
        with self.prefill.lease(backend):
            await self._run_prefill(route, backend, data)

    async def _run_prefill(self, route: PromptRoute, backend: Backend, data: bytes) -> None:
        req = route.request
        started = time.perf_counter()
        try:
            resp = await self.upstream.send(backend, "POST", req.endpoint, data=data, headers=req.headers)
        except UpstreamConnectError as exc:
            self.prefill.mark_down(backend, exc.message)
            raise
        try:
            if 400 <= resp.status < 500:
                raise EngineErrorReply(backend.url, resp.status, await self.upstream.read(backend, resp),
                                       resp.headers)
            if resp.status != 200:
                body = await self.upstream.read(backend, resp)
                raise PrefillFailed("status", f"prefill {backend.url} answered {resp.status}: "
                                    f"{body[:300].decode(errors='replace')}")
            reply = await self.upstream.read_json(backend, resp)
        finally:
            finish(resp)
        self.prefill_answered(route, backend, time.perf_counter() - started, reply)

    async def _decode(self, route: PromptRoute, data: bytes,
                      leases: ExitStack) -> tuple[Backend, aiohttp.ClientResponse]:
        """Decode's request, headers read, on ``route.decode`` or, while engines refuse the
        connection, the next healthy one (recorded in ``route.decode``; its lease joins ``leases``)."""
        req = route.request
        backend: Backend | None = route.decode
        tried: list[Backend] = []
        while backend is not None:
            with ExitStack() as attempt:
                attempt.enter_context(self.decode.lease(backend))
                try:
                    resp = await self.upstream.send(backend, "POST", req.endpoint, data=data, headers=req.headers)
                except UpstreamConnectError as exc:
                    self.decode.mark_down(backend, exc.message)
                    tried.append(backend)
                    backend = self.decode.pick(exclude=tried)
                    continue
                route.decode = backend
                leases.enter_context(attempt.pop_all())
                return backend, resp
        raise NoHealthyBackend(f"no healthy decode instance: {self.decode.describe()}")

    async def _watch(self, prefill: asyncio.Task[None], route: PromptRoute) -> None:
        """After decode answered: wait for prefill; a failure now is logged, never raised (decode
        recomputes what it did not receive)."""
        try:
            await prefill
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("request %s: prefill %s failed after decode %s answered (%s); decode computes what "
                        "it did not receive", route.request.request_id, route.prefill.url if route.prefill else "?",
                        route.decode.url if route.decode else "?", exc)


def _pick(pool: BackendPool, preset: Backend | None) -> Backend | None:
    """The routing policy's engine while it is healthy, else the pool's best."""
    return preset if preset is not None and preset.healthy else pool.pick()


async def _close(*tasks: asyncio.Task[Any] | None) -> None:
    """Cancel the unfinished ``tasks`` and wait for them; decode's response (a ``(backend, response)``
    result) is released if read to the end, else closed (which aborts the engine's request)."""
    live = [t for t in tasks if t is not None]
    for task in live:
        if not task.done():
            task.cancel()
    for task in live:
        with suppress(BaseException):
            result = await task
            if isinstance(result, tuple) and isinstance(result[1], aiohttp.ClientResponse):
                finish(result[1])
