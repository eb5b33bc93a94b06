"""Talking to engines: one aiohttp client session, the timeouts, and the
boundary where client exceptions become :mod:`disagg.proxy.errors`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from contextlib import ExitStack, asynccontextmanager
from typing import Any

import aiohttp
from multidict import CIMultiDict
from yarl import URL

from disagg.proxy.backends import Backend, BackendPool
from disagg.proxy.config import ProxyTimeouts
from disagg.proxy.errors import (
    CLIENT_ERRORS,
    NoHealthyBackend,
    UpstreamBadReply,
    UpstreamConnectError,
    UpstreamError,
    map_client_error,
)
from disagg.proxy.metrics import ProxyMetrics

#: seconds an idle engine connection is kept for reuse
KEEPALIVE_S = 3.0


def make_session(timeouts: ProxyTimeouts) -> aiohttp.ClientSession:
    """The proxy's client session: unlimited pooled keep-alive connections,
    bodies passed through undecoded.

    Idle connections are dropped after :data:`KEEPALIVE_S`, shorter than
    vLLM's own 5 s (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``): reusing a connection
    the engine is closing would fail a POST, which is not retried.
    """
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeouts.connect, sock_read=timeouts.request)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False)


class Upstream:
    """Sends requests to backends of a pool and maps every failure.

    Every engine request goes through :meth:`send`, which sets
    ``Authorization: Bearer <engine_key>`` when the proxy has an engine key
    (``ProxyConfig.engine_key``) and drops any other credentials.
    """

    def __init__(self, session: aiohttp.ClientSession, timeouts: ProxyTimeouts, metrics: ProxyMetrics,
                 engine_key: str | None = None) -> None:
        self.session = session
        self.timeouts = timeouts
        self._metrics = metrics
        self._authorization = f"Bearer {engine_key}" if engine_key else None

    def engine_headers(self, headers: Mapping[str, str]) -> CIMultiDict[str]:
        """``headers`` as sent to an engine: the engine key's ``Authorization``, or none at all
        (a caller's ``Authorization`` or ``Proxy-Authorization`` never reaches an engine)."""
        out = CIMultiDict(headers)
        for name in ("Authorization", "Proxy-Authorization"):
            out.popall(name, None)
        if self._authorization is not None:
            out["Authorization"] = self._authorization
        return out

    async def send(self, backend: Backend, method: str, path: str, *, data: bytes | None,
                   headers: Mapping[str, str]) -> aiohttp.ClientResponse:
        """Send one request; returns the response with its headers read.

        ``path`` is sent as it is (already percent-encoded, query included), never resolved
        again: the client's paths reach here only through
        :func:`disagg.proxy.engine_routes.path_problem`. The caller owns the response: read it,
        then ``release()``, or ``close()`` it to abort the engine's work.
        """
        try:
            return await self.session.request(method, URL(backend.url + path, encoded=True), data=data,
                                              headers=self.engine_headers(headers), allow_redirects=False)
        except CLIENT_ERRORS as exc:
            raise self.failed(backend, exc) from exc

    async def read(self, backend: Backend, resp: aiohttp.ClientResponse) -> bytes:
        """The whole body of ``resp``."""
        try:
            return await resp.read()
        except CLIENT_ERRORS as exc:
            raise self.failed(backend, exc) from exc

    async def read_json(self, backend: Backend, resp: aiohttp.ClientResponse) -> dict[str, Any]:
        """The body of ``resp`` as a JSON object."""
        body = await self.read(backend, resp)
        try:
            value = json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise self.failed(backend, exc) from exc
        if not isinstance(value, dict):
            raise UpstreamBadReply(backend.url, f"expected a JSON object, got {type(value).__name__}")
        return value

    def failed(self, backend: Backend, exc: BaseException) -> UpstreamError:
        """Map ``exc`` and count it."""
        err = map_client_error(exc, backend.url, self.timeouts.request)
        self._metrics.upstream_errors.labels(backend.role, err.kind).inc()
        return err

    async def open(self, pool: BackendPool, method: str, path: str, *, data: bytes | None,
                   headers: Mapping[str, str], prefer: Backend | None,
                   leases: ExitStack) -> tuple[Backend, aiohttp.ClientResponse]:
        """Send to ``prefer`` while it is healthy (the routing policy's pick), else to the best
        backend of ``pool``; returns ``(backend, response)`` with the response's headers read.

        A backend that refuses the connection is taken out and the next one is tried (the
        request never reached it); :class:`NoHealthyBackend` when none is left. The chosen
        backend's lease joins ``leases``; the caller owns the response (:func:`finish` it).
        :meth:`request`, and handoffs that keep a decode reply open beyond one block
        (:mod:`disagg.proxy.concurrent_handoff`).
        """
        tried: list[Backend] = []
        while True:
            backend = prefer if prefer is not None and prefer.healthy and not tried else pool.pick(exclude=tried)
            if backend is None:
                raise NoHealthyBackend(f"no healthy {pool.role} instance: {pool.describe()}")
            with ExitStack() as attempt:
                attempt.enter_context(pool.lease(backend))
                try:
                    resp = await self.send(backend, method, path, data=data, headers=headers)
                except UpstreamConnectError as exc:
                    pool.mark_down(backend, exc.message)
                    tried.append(backend)
                    continue
                leases.enter_context(attempt.pop_all())
                return backend, resp

    @asynccontextmanager
    async def request(self, pool: BackendPool, method: str, path: str, *, data: bytes | None,
                      headers: Mapping[str, str],
                      prefer: Backend | None = None) -> AsyncIterator[tuple[Backend, aiohttp.ClientResponse]]:
        """:meth:`open` for one block: yields ``(backend, response)``; the backend stays leased
        until the block exits, then the response is released, or closed (aborting the engine's
        request) if its body was not read to the end."""
        with ExitStack() as leases:
            backend, resp = await self.open(pool, method, path, data=data, headers=headers, prefer=prefer,
                                            leases=leases)
            try:
                yield backend, resp
            finally:
                finish(resp)


def finish(resp: aiohttp.ClientResponse) -> None:
    """Release a fully read response; close (abort) one that is not."""
    if resp.content.at_eof():
        resp.release()
    else:
        resp.close()
