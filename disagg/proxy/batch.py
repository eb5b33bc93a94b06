"""Serving a batch: one route per prompt, concurrently, joined into one reply.

Called by :func:`disagg.proxy.app._generate` for a plan with several routes
(a ``/v1/completions`` list ``prompt``). Each route runs in a task of its own
(:class:`_RouteRun`): it opens its reply through ``open_route`` (the same
function the proxy uses for a single route: handoff, fallback or decode
alone), then reads it whole, or feeds its SSE events into one queue. At most
``max_parallel`` routes of one request run at once.

The client gets exactly what one vLLM server returns for the batch
(:mod:`disagg.proxy.merge`):

- An error before any output (a prompt over the context, a bad field) is
  the reply of the lowest-numbered prompt that failed, with its status and
  body, and the other routes are cancelled; vLLM checks every prompt before
  it starts, so nothing is streamed first. (Beyond ``max_parallel`` prompts
  in a streamed batch, a later prompt's error arrives as vLLM's in-stream
  error event instead.)
- Streamed: the events of all prompts as they come, re-indexed, one usage
  chunk, one ``[DONE]``; an engine failing mid-stream gives vLLM's error
  event, then ``[DONE]``, and the other routes are cancelled.

A client that leaves cancels the handler; every route task is cancelled and
closes its engine requests (which aborts them in the engines). A client that
stays but stops reading is let go after ``timeouts.send`` seconds without
progress (:func:`disagg.proxy.admission.send_within`), the same way. Until
then the merger holds at most :data:`QUEUED_EVENTS_PER_ROUTE` events per route
running: a route whose events wait stops reading its engine's stream, so
the engine's own TCP buffers, not the proxy's memory, take the backlog.

How many routes run at once (:func:`batch_parallelism`): at most
:data:`MAX_PARALLEL_ROUTES`, at most ``max_concurrency`` (each counts as one
engine request against it), and few enough that their request bodies in flight
stay within :data:`BODY_BYTES_IN_FLIGHT` (a batch with a 2 MB shared field runs
3 at a time): the memory they hold, and the event loop's time spent serialising
them in one turn, stay bounded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AsyncExitStack, suppress
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from disagg.proxy.admission import send_within
from disagg.proxy.backends import Backend
from disagg.proxy.errors import CLIENT_ERRORS, ProxyHTTPError, UpstreamBadReply, sse_error_event
from disagg.proxy.handoff import DecodeReply, EngineErrorReply
from disagg.proxy.headers import downstream_headers
from disagg.proxy.merge import (
    batch_id,
    is_error_event,
    is_usage_chunk,
    merge_replies,
    merge_usage_chunks,
    reindex,
)
from disagg.proxy.relay import StreamTiming, is_event_stream
from disagg.proxy.routes import PromptRoute, RequestPlan
from disagg.proxy.upstream import Upstream
from disagg.sse import DONE_EVENT, SSEError, SSEParser, encode_event, encode_json_event

log = logging.getLogger("disagg.proxy")

#: routes of one client request served at once
MAX_PARALLEL_ROUTES = 32
#: request bytes of one batch's routes in flight at once (each route's body holds the shared fields)
BODY_BYTES_IN_FLIGHT = 8 * 1024 * 1024
#: events of a streamed batch waiting for the client, per route running
QUEUED_EVENTS_PER_ROUTE = 16


def batch_parallelism(plan: RequestPlan, max_concurrency: int) -> int:
    """How many of ``plan``'s routes run at once (1 for a single route): the slots it takes
    against the proxy's concurrency cap."""
    if not plan.batched:
        return 1
    shared = plan.routes[0].request.shared
    body_bytes = len(shared.encoded) if shared is not None else len(plan.request.raw)
    return max(1, min(len(plan.routes), MAX_PARALLEL_ROUTES, max_concurrency,
                      BODY_BYTES_IN_FLIGHT // max(1, body_bytes)))

OpenRoute = Callable[[PromptRoute, AsyncExitStack], Awaitable[DecodeReply]]


@dataclass
class _Opened:
    """A route's reply status and headers; ``body`` when it is not a stream to merge."""

    status: int
    headers: CIMultiDictProxy[str]
    body: bytes | None = None


#: a queue item: (route index, event data or None at the route's end, or raw bytes of a final error event)
_Item = tuple[int, Any]


class _RouteRun:
    """One route of the batch, run in its own task."""

    def __init__(self, route: PromptRoute, open_route: OpenRoute, upstream: Upstream,
                 limit: asyncio.Semaphore, queue: asyncio.Queue[_Item] | None) -> None:
        self.route = route
        self._open_route = open_route
        self._upstream = upstream
        self._limit = limit
        self._queue = queue      # None: read the reply whole
        self.opened: asyncio.Future[_Opened] = asyncio.get_running_loop().create_future()

    async def run(self) -> None:
        try:
            async with self._limit, AsyncExitStack() as stack:
                reply = await self._open_route(self.route, stack)
                resp = reply.response
                if self._queue is None or resp.status != 200:
                    body = await self._upstream.read(reply.backend, resp)
                    await reply.settle()
                    self.opened.set_result(_Opened(resp.status, resp.headers, body))
                    if self._queue is not None:  # streaming may have begun: the error goes in-stream
                        await self._queue.put((self.route.index, _error_event(resp.status, body)))
                    return
                if not is_event_stream(resp):
                    raise UpstreamBadReply(reply.backend.url, "answered a streamed request without a stream")
                self.opened.set_result(_Opened(resp.status, resp.headers))
                await self._pump(reply.backend, resp.content)
                await reply.settle()  # a concurrent protocol's prefill request
        except asyncio.CancelledError:
            if not self.opened.done():
                self.opened.cancel()
            raise
        except Exception as exc:
            if not self.opened.done():
                self.opened.set_exception(exc)
                if self._queue is None:
                    return
                # a stream may have begun without this route (beyond the first routes run at once):
                # its failure goes in-stream, and its exception counts as seen
                self.opened.exception()
                await self._queue.put((self.route.index, _failure_event(exc)))
                return
            if self._queue is not None:
                log.warning("request %s: %s", self.route.request.request_id, exc)
                await self._queue.put((self.route.index, sse_error_event(502, f"batch prompt failed: {exc}")))
                return
        if self._queue is not None:
            await self._queue.put((self.route.index, None))

    async def _pump(self, backend: Backend, content: Any) -> None:
        """Every event of this route's stream into the queue (parsed JSON, or raw data)."""
        assert self._queue is not None
        parser = SSEParser()
        while True:
            try:
                chunk = await content.readany()
            except CLIENT_ERRORS as exc:
                err = self._upstream.failed(backend, exc)
                log.warning("decode stream broke: %s", err.message)
                await self._queue.put((self.route.index, sse_error_event(err.status, f"decode stream broke: "
                                                                                     f"{err.message}")))
                return
            if not chunk:
                return
            try:
                events = parser.feed(chunk)
            except SSEError as exc:
                raise UpstreamBadReply(backend.url, str(exc)) from None
            for event in events:
                if event.done:
                    continue
                try:
                    value = event.json()
                except ValueError:
                    value = event.data
                await self._queue.put((self.route.index, value))


async def _first_failure(runs: list[_RouteRun]) -> _Opened | None:
    """Wait until every route of ``runs`` has answered; the lowest-numbered failure, if any.

    Raises the exception of the lowest-numbered route that raised one (a
    proxy error the front door turns into the client's error).
    """
    pending = {r.opened for r in runs}
    while pending:
        _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        failed = [r for r in runs if r.opened.done() and not r.opened.cancelled()
                  and (r.opened.exception() is not None or r.opened.result().status != 200)]
        if failed:
            first = failed[0]
            exc = first.opened.exception()
            if exc is not None:
                raise exc
            return first.opened.result()
    return None


async def serve_batch(request: web.Request, plan: RequestPlan, open_route: OpenRoute, upstream: Upstream,
                      timing: StreamTiming, max_parallel: int = MAX_PARALLEL_ROUTES,
                      extra: Callable[[], Mapping[str, str]] | None = None) -> web.StreamResponse:
    """Serve every route of ``plan`` and answer the client as one vLLM server would
    (``extra``: called once every route is open, the headers added to a successful reply, e.g.
    the routing's path header)."""
    rid = plan.request.request_id
    queue: asyncio.Queue[_Item] | None = \
        asyncio.Queue(QUEUED_EVENTS_PER_ROUTE * max_parallel) if plan.request.stream else None
    limit = asyncio.Semaphore(max_parallel)
    runs = [_RouteRun(route, open_route, upstream, limit, queue) for route in plan.routes]
    tasks = [asyncio.create_task(run.run(), name=f"disagg-route-{rid}-{run.route.index}") for run in runs]
    try:
        # a stream starts once the first routes have answered (the others wait for a free route, and
        # their events for the client); a reply read whole waits for every route
        failure = await _first_failure(runs[:max_parallel] if queue is not None else runs)
        if failure is not None:
            return web.Response(status=failure.status, body=failure.body,
                                headers=downstream_headers(failure.headers, rid))
        first = runs[0].opened.result()
        headers = downstream_headers(first.headers, rid)
        if extra is not None:
            headers.update(extra())
        if queue is None:
            replies = [_json_object(run) for run in runs]
            merged = json.dumps(merge_replies(replies, rid)).encode()
            return web.Response(status=200, body=merged, headers=headers)
        return await _stream(request, queue, len(runs), headers, rid, timing, upstream.timeouts.send)
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with suppress(BaseException):
                await task


def _error_event(status: int, body: bytes) -> bytes:
    """An engine's error reply as the in-stream error event vLLM writes, then ``[DONE]``."""
    try:
        value = json.loads(body)
    except ValueError:
        value = None
    if isinstance(value, dict) and isinstance(value.get("error"), dict):
        return b"data: " + json.dumps(value).encode() + b"\n\n" + DONE_EVENT
    return sse_error_event(status, body.decode("utf-8", "replace")[:1000] or f"HTTP {status}")


def _failure_event(exc: Exception) -> bytes:
    """A route that failed before it answered, as the in-stream error event of a stream under way:
    an engine's own error reply as it is, a proxy error with its status."""
    if isinstance(exc, EngineErrorReply):
        return _error_event(exc.status, exc.body)
    status = exc.status if isinstance(exc, ProxyHTTPError) else 502
    return sse_error_event(status, f"batch prompt failed: {exc}")


def _json_object(run: _RouteRun) -> dict[str, Any]:
    body = run.opened.result().body or b""
    try:
        value = json.loads(body)
    except ValueError as exc:
        raise UpstreamBadReply(run.route.decode.url if run.route.decode else "decode",
                               f"unreadable reply ({exc})") from None
    if not isinstance(value, dict):
        raise UpstreamBadReply("decode", f"expected a JSON object, got {type(value).__name__}")
    return value


async def _stream(request: web.Request, queue: asyncio.Queue[_Item], routes: int, headers: CIMultiDict[str],
                  rid: str, timing: StreamTiming, send_timeout: float) -> web.StreamResponse:
    """Relay the routes' events as they come, re-indexed; one usage chunk and one ``[DONE]`` at the end
    (each write within ``send_timeout``, else the client is let go)."""
    out = web.StreamResponse(status=200, headers=headers)
    await out.prepare(request)

    async def write(data: bytes) -> None:
        await send_within(request, out.write(data), send_timeout)

    reply_id = batch_id(rid)
    usage: dict[int, dict[str, Any]] = {}
    ended = 0
    while ended < routes:
        index, value = await queue.get()
        if value is None:
            ended += 1
            continue
        if isinstance(value, bytes) and value.startswith(b"data: "):  # a route's final error event
            timing.broken = True
            await write(value)
            await send_within(request, out.write_eof(), send_timeout)
            return out
        if isinstance(value, dict) and is_usage_chunk(value):
            usage[index] = value
            continue
        if isinstance(value, dict) and is_error_event(value):
            timing.broken = True
            await write(encode_json_event(value) + DONE_EVENT)
            await send_within(request, out.write_eof(), send_timeout)
            return out
        data = encode_json_event(reindex(value, index, reply_id)) if isinstance(value, dict) else encode_event(value)
        await write(data)
        now = time.perf_counter()
        if timing.first is None:
            timing.first = now
        timing.token_events += 1
        timing.last = now
    if usage:
        await write(encode_json_event(merge_usage_chunks([usage[i] for i in sorted(usage)], rid)))
    await write(DONE_EVENT)
    await send_within(request, out.write_eof(), send_timeout)
    return out
