"""vLLM handoffs that send prefill and decode their requests at the same time.

Two protocols share this: the socket connector's streaming mode
(:class:`disagg.proxy.socket_stream_handoff.SocketStreamHandoff`: decode receives
each layer's KV while prefill computes) and NIXL's push mode
(:class:`disagg.proxy.nixl_push_handoff.NixlPushHandoff`: decode registers its
blocks with prefill, which WRITEs into them when it finishes). The proxy
(:func:`disagg.proxy.app._open_reply`) calls :meth:`ConcurrentVllmHandoff.serve`
once per ``split`` route; a subclass says what each side gets
(:meth:`ConcurrentVllmHandoff.dispatch`) and whether decode's reply waits for
prefill's (:attr:`ConcurrentVllmHandoff.hold_decode`).

Per route: prefill (P) gets :meth:`VllmHandoff.prefill_body` (one token, not
streamed, ``n: 1``) with the dispatch's prefill ``kv_transfer_params``; decode
(D) gets the client's request with the dispatch's decode ``kv_transfer_params``;
both go out at once with the dispatch's headers. P's reply is read and, past
:meth:`ConcurrentVllmHandoff.check_prefill`, dropped (its time and prompt token
count go to the route's learner and ``prefill_seconds``, as for
:class:`VllmHandoff`). The client gets D's reply.

Failures:

- P answers 4xx before D's response headers arrived (or, with
  :attr:`~ConcurrentVllmHandoff.hold_decode`, before the handoff yields D's
  reply): the client gets P's status and body unchanged
  (:class:`EngineErrorReply`); D's request is closed.
- P fails otherwise at that point (connection refused: P is taken out; 5xx;
  timeout; broken reply; a reply :meth:`~ConcurrentVllmHandoff.check_prefill`
  refuses): D's request is closed and :class:`PrefillFailed` lets the proxy's
  fallback serve the prompt on decode alone (or answer 503 with ``--fallback
  never``). No healthy prefill instance: the same, before anything is sent.
- P fails after D answered (only without ``hold_decode``): a warning; D goes on
  (it recomputes what it did not receive) and is never closed for it.
- D answers an error status: relayed unchanged, and P's request is closed. D
  refusing the connection: it is taken out and the next healthy decode
  instance gets the same request.
- On exit (normal, error, the client leaving) both engine requests are closed
  if unfinished, and every lease is released. A prefill request still running
  when D's reply is yielded is the reply's ``companion``
  (:attr:`~disagg.proxy.handoff.DecodeReply.release_companion`): once the
  proxy relayed D's whole reply, P's request is cancelled if P has not
  answered yet (D then computed the prompt itself: it gave up waiting for a
  queued P, or the stream failed), so P does not go on
  computing it or hold its blocks for a reader that never comes; logged and
  counted in ``disagg_proxy_prefills_dropped_total``. A P that answered is
  left to finish.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from abc import abstractmethod
from collections.abc import AsyncIterator, Mapping
from contextlib import ExitStack, asynccontextmanager, suppress
from dataclasses import dataclass
from typing import Any, ClassVar

import aiohttp

from disagg.proxy.backends import Backend, BackendPool
from disagg.proxy.errors import NoHealthyBackend, UpstreamConnectError, UpstreamError
from disagg.proxy.handoff import DecodeReply, PrefillFailed, VllmHandoff
from disagg.proxy.routes import PromptRoute
from disagg.proxy.upstream import finish

log = logging.getLogger("disagg.proxy")


@dataclass
class PrefillProgress:
    """One route's prefill request as :meth:`ConcurrentVllmHandoff.serve` follows it."""

    #: prefill's response headers arrived (it computed the prompt; its reply is being read)
    answered: bool = False
    #: cancelled because decode's reply was complete first (:meth:`ConcurrentVllmHandoff._drop`)
    dropped: bool = False


@dataclass(frozen=True)
class Dispatch:
    """What one route sends: each side's ``kv_transfer_params`` and the headers both requests carry."""

    prefill_params: dict[str, Any]
    decode_params: dict[str, Any]
    headers: Mapping[str, str]
    #: what ``headers``' ``X-Request-Id`` appends to the client's request id
    #: (:attr:`~disagg.proxy.handoff.DecodeReply.id_suffix`)
    id_suffix: str = ""


class ConcurrentVllmHandoff(VllmHandoff):
    """vLLM prefill and decode in parallel (see the module docstring); subclasses implement
    :meth:`dispatch`."""

    #: hold decode's reply until prefill answered: every prefill failure then comes before the
    #: client saw anything, so decode's request is closed and the fallback applies (a decode
    #: that cannot recompute what it did not receive: NIXL push). False: yield decode's reply as
    #: soon as its headers arrive and let prefill finish beside it (the socket stream)
    hold_decode: ClassVar[bool] = False

    @abstractmethod
    def dispatch(self, route: PromptRoute, prefill: Backend) -> Dispatch:
        """What the route's two requests carry, ``prefill`` being the prefill engine chosen for it
        (:meth:`serve` calls it once per route, after choosing both engines)."""

    def check_prefill(self, route: PromptRoute, backend: Backend, reply: Mapping[str, Any]) -> None:
        """Prefill ``backend`` answered ``route`` 200 with ``reply`` (a JSON object); raise
        :class:`PrefillFailed` to treat it as a failure. Called before the route's learner is told.
        Default: any such reply will do."""

    def pick_prefill(self, route: PromptRoute) -> Backend:
        """The route's prefill engine, or a healthy one (:func:`pick`); PrefillFailed
        (``no_healthy_prefill``) when there is none. Subclasses that choose how to serve by the
        prefill engine (:class:`~disagg.proxy.nixl_push_handoff.NixlPushHandoff`) pick with it too."""
        p_backend = pick(self.prefill, route.prefill)
        if p_backend is None:
            raise PrefillFailed("no_healthy_prefill", f"no healthy prefill instance: {self.prefill.describe()}")
        return p_backend

    @asynccontextmanager
    async def serve(self, route: PromptRoute) -> AsyncIterator[DecodeReply]:
        """Send prefill and decode their requests at once; yield decode's reply."""
        req = route.request
        p_backend = self.pick_prefill(route)
        d_backend = pick(self.decode, route.decode)
        if d_backend is None:
            raise NoHealthyBackend(f"no healthy decode instance: {self.decode.describe()}")
        route.prefill, route.decode = p_backend, d_backend
        plan = self.dispatch(route, p_backend)
        route.kv_transfer_params = plan.decode_params
        p_data = json.dumps(self.prefill_body(req.endpoint, req.body, plan.prefill_params)).encode()
        d_data = json.dumps(self.decode_body(req.body, plan.decode_params)).encode()
        with ExitStack() as leases:
            progress = PrefillProgress()
            p_task = asyncio.create_task(self._prefill(route, p_backend, p_data, plan.headers, progress))
            d_task = asyncio.create_task(self._decode(route, d_data, plan.headers, leases))
            watcher: asyncio.Task[None] | None = None
            try:
                await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_COMPLETED)
                if self.hold_decode and not p_task.done() and _answered(d_task, ok=True):
                    await asyncio.wait({p_task})        # decode answered 200: it waits for prefill
                if p_task.done() and (self.hold_decode or not _answered(d_task)):
                    failure = p_task.exception()        # if it failed, the finally closes decode's request
                    if isinstance(failure, UpstreamError):
                        raise PrefillFailed(failure.kind, f"prefill {failure.message}") from failure
                    if failure is not None:             # PrefillFailed (5xx), EngineErrorReply (4xx: the client's)
                        raise failure
                d_used, resp = await d_task
                if resp.status != 200:
                    yield DecodeReply(d_used, resp, id_suffix=plan.id_suffix)   # decode's own error, as it answered
                    return
                if self.hold_decode:                    # prefill answered: the handoff's time runs from there
                    yield DecodeReply(d_used, resp, prefill_done=p_task.result(), id_suffix=plan.id_suffix)
                    return
                watcher = asyncio.create_task(self._watch(p_task, route, progress))
                yield DecodeReply(d_used, resp, companion=watcher, id_suffix=plan.id_suffix,
                                  release_companion=lambda: self._drop(p_task, route, progress))
            finally:
                await close_tasks(watcher, p_task, d_task)   # and closes decode's response if unfinished

    async def _prefill(self, route: PromptRoute, backend: Backend, data: bytes, headers: Mapping[str, str],
                       progress: PrefillProgress) -> float:
        """Prefill's request; its reply is checked and dropped; returns when (perf_counter) it
        answered. Raises on any failure. The prefill engine counts the request in flight only while
        it runs (not for the decode's whole reply)."""
        with self.prefill.lease(backend):
            return await self._run_prefill(route, backend, data, headers, progress)

    async def _run_prefill(self, route: PromptRoute, backend: Backend, data: bytes,
                           headers: Mapping[str, str], progress: PrefillProgress) -> float:
        req = route.request
        started = time.perf_counter()
        try:
            resp = await self.upstream.send(backend, "POST", req.endpoint, data=data, headers=headers)
        except UpstreamConnectError as exc:
            self.prefill.mark_down(backend, exc.message)
            raise
        progress.answered = True
        try:
            reply = await self.read_prefill_reply(backend, resp)
        finally:
            finish(resp)
        answered = time.perf_counter()
        self.check_prefill(route, backend, reply)
        self.prefill_answered(route, backend, answered - started, reply)
        return answered

    async def _decode(self, route: PromptRoute, data: bytes, headers: Mapping[str, str],
                      leases: ExitStack) -> tuple[Backend, aiohttp.ClientResponse]:
        """Decode's request, headers read, on ``route.decode`` or, while engines refuse the
        connection, the next healthy one (:meth:`Upstream.open <disagg.proxy.upstream.Upstream.open>`;
        recorded in ``route.decode``; its lease joins ``leases``)."""
        backend, resp = await self.upstream.open(self.decode, "POST", route.request.endpoint, data=data,
                                                 headers=headers, prefer=route.decode, leases=leases)
        route.decode = backend
        return backend, resp

    async def _watch(self, prefill: asyncio.Task[float], route: PromptRoute, progress: PrefillProgress) -> None:
        """After decode answered: wait for prefill; a failure now is logged, never raised (decode
        recomputes what it did not receive), and so is a prefill :meth:`_drop` cancelled."""
        try:
            await prefill
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if progress.dropped and current is not None and not current.cancelling():
                return  # only prefill's request was cancelled, by _drop
            raise
        except Exception as exc:
            log.warning("request %s: prefill %s failed after decode %s answered (%s); decode computes what "
                        "it did not receive", route.request.request_id, route.prefill.url if route.prefill else "?",
                        route.decode.url if route.decode else "?", exc)

    def _drop(self, prefill: asyncio.Task[float], route: PromptRoute, progress: PrefillProgress) -> None:
        """Decode's reply is complete (:meth:`DecodeReply.settle`): cancel a prefill request that has
        not answered (its engine aborts it: no compute, no blocks held), log it and count it."""
        if prefill.done() or progress.answered:
            return
        progress.dropped = True
        prefill.cancel()
        self.metrics.prefills_dropped.inc()
        log.info("request %s: decode %s finished its reply before prefill %s answered; prefill's request "
                 "cancelled (decode no longer needs it)", route.request.request_id,
                 route.decode.url if route.decode else "?", route.prefill.url if route.prefill else "?")


def _answered(decode: asyncio.Task[tuple[Backend, aiohttp.ClientResponse]], ok: bool = False) -> bool:
    """Whether decode's request has its response headers (with ``ok``: and its status is 200)."""
    if not decode.done() or decode.cancelled() or decode.exception() is not None:
        return False
    return not ok or decode.result()[1].status == 200


def pick(pool: BackendPool, preset: Backend | None) -> Backend | None:
    """The routing policy's engine while it is healthy, else the pool's best."""
    return preset if preset is not None and preset.healthy else pool.pick()


async def close_tasks(*tasks: asyncio.Task[Any] | None) -> None:
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
