"""What one client may make the proxy do: the concurrency cap counted in engine requests,
the body read within its timeout, the client's request id, and writes that give up on a
client that stopped reading.

Callers: :func:`disagg.proxy.app._front_door` reads every body (:func:`read_body`) and
picks the request id (:func:`request_id_of`) before any slot is taken; the handlers take
their slots (:meth:`Budget.take`) once they know how many engine requests they will run
at once; :mod:`disagg.proxy.relay` and :mod:`disagg.proxy.batch` write streams with
:func:`send_within`.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager

from aiohttp import web

from disagg.proxy.errors import RequestTimeout, TooManyRequests
from disagg.proxy.metrics import ProxyMetrics

log = logging.getLogger("disagg.proxy")

#: longest client ``X-Request-Id`` passed on to engines (printable ASCII, no spaces); engines and the
#: socket connector add their own prefixes and suffixes to it
MAX_REQUEST_ID_CHARS = 128
#: response header telling a client its ``X-Request-Id`` was replaced, and why
REQUEST_ID_REPLACED = "X-Disagg-Request-Id-Replaced"


class Budget:
    """A count the proxy holds below ``limit`` while requests run: :meth:`take` holds an amount
    for a block, or refuses it with 429 (counted as ``rejected_total{reason}``) before any work.

    Two are made per app (:class:`disagg.proxy.app.ProxyState`): the concurrency cap, in engine
    requests (a single prompt one, a split batch as many as it serves in parallel; the
    ``active_requests`` gauge follows it), and the bytes of request bodies being read at once
    (announced sizes: many clients uploading at once cannot fill memory before the cap sees them).
    """

    def __init__(self, limit: int, metrics: ProxyMetrics, *, what: str, setting: str, reason: str,
                 gauge: bool = False) -> None:
        self.limit = limit
        self.used = 0
        self._metrics = metrics
        self._what = what          # what is counted, for the refusal's message
        self._setting = setting    # the setting that sets ``limit``
        self._reason = reason      # the ``rejected_total`` label of a refusal
        self._gauge = gauge        # whether ``active_requests`` follows the count

    @contextmanager
    def take(self, n: int = 1) -> Iterator[None]:
        """Hold ``n`` for the block; raises :class:`TooManyRequests` when it does not fit."""
        if self.used + n > self.limit:
            self._metrics.rejected.labels(self._reason).inc()
            raise TooManyRequests(f"the proxy holds {self.used} {self._what}, its limit is {self.limit} "
                                  f"({self._setting}) and this request needs {n}; retry after "
                                  f"{TooManyRequests.retry_after_s} s")
        self.used += n
        if self._gauge:
            self._metrics.active.inc(n)
        try:
            yield
        finally:
            self.used -= n
            if self._gauge:
                self._metrics.active.dec(n)


def request_id_of(request: web.Request) -> tuple[str, str | None]:
    """The id engines see for ``request``: the client's ``X-Request-Id`` when it is at most
    :data:`MAX_REQUEST_ID_CHARS` printable ASCII characters without spaces, else a new one;
    and why the client's was replaced (None when kept or absent)."""
    given = request.headers.get("X-Request-Id")
    if not given:
        return uuid.uuid4().hex, None
    if len(given) > MAX_REQUEST_ID_CHARS:
        return uuid.uuid4().hex, f"longer than {MAX_REQUEST_ID_CHARS} characters"
    if not all("!" <= ch <= "~" for ch in given):
        return uuid.uuid4().hex, "not printable ASCII without spaces"
    return given, None


async def read_body(request: web.Request, timeout: float) -> bytes:
    """The whole body of ``request`` (aiohttp keeps it for the handler's ``request.read()``),
    within ``timeout`` seconds; raises :class:`RequestTimeout` (408; aiohttp then closes the
    connection) when it does not arrive in time, and aiohttp's 413 when it exceeds the app's
    size limit."""
    try:
        async with asyncio.timeout(timeout):
            return await request.read()
    except TimeoutError:
        raise RequestTimeout(f"the request body did not arrive within {timeout:g} s "
                             "(timeouts.client_body)") from None


class ClientStalled(ConnectionResetError):
    """A client read nothing of its reply for ``timeouts.send`` seconds; its connection is closed."""


async def send_within(request: web.Request, sending: Awaitable[object], timeout: float) -> None:
    """Await ``sending`` (a write to ``request``'s response, or its end), giving up on a client
    that has not read for ``timeout`` seconds: the connection is closed and :class:`ClientStalled`
    raised, so the handler ends, its slots are freed and its engine requests closed (aborted)."""
    try:
        async with asyncio.timeout(timeout):
            await sending
    except TimeoutError:
        transport = request.transport
        if transport is not None:
            transport.abort()
        raise ClientStalled(f"the client read nothing for {timeout:g} s (timeouts.send)") from None
