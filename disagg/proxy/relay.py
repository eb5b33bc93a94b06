"""Relaying an engine's reply to the client: whole bodies at once, SSE streams
chunk by chunk as they arrive, with the proxy-side timing metrics."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from disagg.proxy.admission import send_within
from disagg.proxy.backends import Backend
from disagg.proxy.errors import CLIENT_ERRORS, sse_error_event
from disagg.proxy.headers import downstream_headers
from disagg.proxy.metrics import ProxyMetrics
from disagg.proxy.upstream import Upstream
from disagg.sse import SSEError, SSEParser

log = logging.getLogger("disagg.proxy")

_USAGE_ONLY = b'"choices":[]'


@dataclass
class StreamTiming:
    """What the proxy saw of one stream (for metrics and tests)."""

    started: float                      # perf_counter at request arrival
    first: float | None = None          # first event sent
    last: float | None = None           # last token event sent
    token_events: int = 0
    broken: bool = False                # the engine failed mid-stream
    #: called with ``first`` when the first event is sent (the routing learns from it)
    on_first: Callable[[float], None] | None = None

    def mark_first(self, now: float) -> None:
        """The first event was sent at ``now``."""
        self.first = now
        if self.on_first is not None:
            self.on_first(now)


class SuffixStrip:
    """Removes every occurrence of ``suffix`` from a byte stream fed chunk by chunk, holding back
    only a chunk's tail that may be the start of one (so an SSE event's end is never held)."""

    def __init__(self, suffix: bytes) -> None:
        if not suffix:
            raise ValueError("empty suffix")
        self.suffix = suffix
        self._held = b""

    def feed(self, chunk: bytes) -> bytes:
        """What of ``chunk`` (after what was held) can go out now."""
        data = (self._held + chunk).replace(self.suffix, b"")
        keep = next((n for n in range(min(len(self.suffix) - 1, len(data)), 0, -1)
                     if data.endswith(self.suffix[:n])), 0)
        self._held = data[len(data) - keep:] if keep else b""
        return data[:len(data) - keep]

    def flush(self) -> bytes:
        """The held tail (the stream ended: it was not the suffix)."""
        out, self._held = self._held, b""
        return out


def is_event_stream(resp: aiohttp.ClientResponse) -> bool:
    """True for a ``text/event-stream`` reply."""
    return resp.content_type == "text/event-stream"


def _headers(resp: aiohttp.ClientResponse, request_id: str, extra: Mapping[str, str] | None) -> CIMultiDict[str]:
    headers = downstream_headers(resp.headers, request_id)
    if extra:
        headers.update(extra)
    return headers


async def relay_whole(upstream: Upstream, backend: Backend, resp: aiohttp.ClientResponse,
                      request_id: str, extra: Mapping[str, str] | None = None, strip: bytes = b"") -> web.Response:
    """The engine's reply as one response: its status, end-to-end headers (plus ``extra``) and body
    (without ``strip``: :attr:`~disagg.proxy.handoff.DecodeReply.id_suffix`)."""
    body = await upstream.read(backend, resp)
    if strip:
        body = body.replace(strip, b"")
    return web.Response(status=resp.status, body=body, headers=_headers(resp, request_id, extra))


async def relay_stream(request: web.Request, upstream: Upstream, backend: Backend,
                       resp: aiohttp.ClientResponse, request_id: str, timing: StreamTiming,
                       extra: Mapping[str, str] | None = None, strip: bytes = b"") -> web.StreamResponse:
    """Pass an SSE reply through event by event, as the engine writes it (without ``strip``:
    :attr:`~disagg.proxy.handoff.DecodeReply.id_suffix`, removed by a :class:`SuffixStrip`).

    If the engine fails after the stream started, the client gets vLLM's
    in-stream error event and ``[DONE]``. A client that goes away raises out
    of here (``ConnectionResetError`` or cancellation), and so does one that
    reads nothing for ``timeouts.send`` seconds (:func:`~disagg.proxy.admission.send_within`);
    the caller's context then closes the engine request.
    """
    out = web.StreamResponse(status=resp.status, headers=_headers(resp, request_id, extra))
    await out.prepare(request)
    send_timeout = upstream.timeouts.send

    async def write(data: bytes) -> None:
        await send_within(request, out.write(data), send_timeout)

    content = resp.content
    parser: SSEParser | None = SSEParser()
    stripper = SuffixStrip(strip) if strip else None
    while True:
        try:
            chunk = await content.readany()
        except CLIENT_ERRORS as exc:
            err = upstream.failed(backend, exc)
            log.warning("decode stream broke: %s", err.message)
            timing.broken = True
            if stripper is not None:
                await write(stripper.flush())
            await write(sse_error_event(err.status, f"decode stream broke: {err.message}"))
            break
        if not chunk:
            if stripper is not None:
                await write(stripper.flush())
            break
        if stripper is not None:
            chunk = stripper.feed(chunk)
            if not chunk:
                continue
        now = time.perf_counter()
        await write(chunk)
        if timing.first is None:
            timing.mark_first(now)
        if parser is None:
            continue
        try:
            events = sum(1 for e in parser.feed(chunk) if not e.done and _USAGE_ONLY not in e.data)
        except SSEError as exc:  # still relayed as it is; only the timing stops
            log.warning("decode stream: %s; token timing stops for this request", exc)
            parser = None
            continue
        if events:
            timing.token_events += events
            timing.last = now
    await send_within(request, out.write_eof(), send_timeout)
    return out


def observe_stream(metrics: ProxyMetrics, timing: StreamTiming, prefill_done: float | None, n: int) -> None:
    """Record TTFT, handoff time and TPOT of a finished stream."""
    if timing.first is None:
        return
    metrics.ttft.observe(timing.first - timing.started)
    if prefill_done is not None:
        metrics.handoff.observe(timing.first - prefill_done)
    if n == 1 and timing.token_events > 1 and timing.last is not None:
        metrics.tpot.observe((timing.last - timing.first) / (timing.token_events - 1))
