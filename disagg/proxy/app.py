"""The proxy's aiohttp application: routes, API key, request ids, error bodies,
the concurrency cap.

Routes (vLLM's shapes and status codes):

- ``POST /v1/completions``, ``POST /v1/chat/completions``: planned as one
  route per prompt (:mod:`disagg.proxy.routes`); a ``split`` route goes
  prefill -> decode through the engine's :class:`~disagg.proxy.handoff.Handoff`,
  a ``local`` one (and every request in colocated mode, no ``--prefill``) whole
  to a decode server; a batch's routes are joined by :mod:`disagg.proxy.batch`.
- ``GET /v1/models``, ``GET /version``, ``POST /tokenize``, ``POST /detokenize``
  and the other vLLM routes :mod:`disagg.proxy.engine_routes` lists as forwarded:
  sent to a decode instance, less any client ``kv_transfer_params``. Every other
  path is a 404 from the proxy, and so is any path with dot segments.
- ``OPTIONS``: answered here (CORS preflight), never forwarded.
- ``GET /health``: 200 while at least one prefill and one decode instance are
  healthy (colocated: one server); ``GET /metrics``: the proxy's own metrics.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AsyncExitStack, suppress
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from disagg.proxy.admission import (
    REQUEST_ID_REPLACED,
    Budget,
    read_body,
    request_id_of,
    send_within,
)
from disagg.proxy.backends import BackendPool, HealthProber
from disagg.proxy.batch import batch_parallelism, serve_batch
from disagg.proxy.config import ProxyConfig
from disagg.proxy.engine_routes import forwarded_routes, path_problem
from disagg.proxy.errors import (
    BadRequest,
    NoHealthyBackend,
    NotFound,
    PrefillUnavailable,
    ProxyHTTPError,
    Unauthorized,
    error_response,
)
from disagg.proxy.handoff import DecodeReply, EngineErrorReply, Handoff, PrefillFailed, handoff_class
from disagg.proxy.headers import REQUEST_ID, downstream_headers, upstream_headers
from disagg.proxy.metrics import CONTENT_TYPE, ProxyMetrics
from disagg.proxy.relay import StreamTiming, is_event_stream, observe_stream, relay_stream, relay_whole
from disagg.proxy.router import ROUTE_HEADER, Router
from disagg.proxy.routes import (
    CHAT,
    COMPLETIONS,
    GenerationRequest,
    PromptRoute,
    RequestPlan,
    RoutePath,
    Served,
    TooManyPrompts,
    plan_request,
    strip_kv_params,
)
from disagg.proxy.upstream import Upstream, make_session

log = logging.getLogger("disagg.proxy")

#: paths that need the API key (as vLLM: /health, /metrics, /version stay open)
GUARDED_PREFIXES = ("/v1",)


#: bytes of request bodies the proxy reads at once (a chunked body counts as ``max_body_bytes``);
#: one more is answered 429 before it is read
BODY_READ_BYTES = 256 * 1024 * 1024

@dataclass
class ProxyState:
    """Everything one app holds; ``upstream``/``handoff`` exist while it runs."""

    config: ProxyConfig
    metrics: ProxyMetrics
    decode: BackendPool
    prefill: BackendPool | None
    handoff_cls: type[Handoff] | None
    router: Router
    upstream: Upstream | None = None
    handoff: Handoff | None = None
    api_key_hash: bytes | None = field(default=None, repr=False)
    #: the concurrency cap, in engine requests
    slots: Budget = field(init=False)
    #: bytes of request bodies being read at once (before any slot is taken)
    reading: Budget = field(init=False)

    def __post_init__(self) -> None:
        self.slots = Budget(self.config.max_concurrency, self.metrics, what="engine requests",
                            setting="max_concurrency", reason="concurrency", gauge=True)
        self.reading = Budget(max(BODY_READ_BYTES, self.config.max_body_bytes), self.metrics,
                              what="bytes of request bodies being read", setting="256 MiB or max_body_bytes",
                              reason="body_budget")

    def client(self) -> Upstream:
        """The upstream client (only while the app runs)."""
        if self.upstream is None:
            raise RuntimeError("the proxy app is not started")
        return self.upstream


STATE: web.AppKey[ProxyState] = web.AppKey("disagg_proxy_state", ProxyState)
REQUEST_ID_KEY: web.RequestKey[str] = web.RequestKey("disagg_request_id", str)
#: why the client's X-Request-Id was replaced (absent when it was not)
REQUEST_ID_NOTE_KEY: web.RequestKey[str] = web.RequestKey("disagg_request_id_note", str)


def build_app(config: ProxyConfig) -> web.Application:
    """The proxy as an aiohttp application (serve it with an ``AppRunner`` with
    ``handler_cancellation=True``, as :class:`~disagg.proxy.server.ProxyServer` does)."""
    metrics = ProxyMetrics()
    decode = BackendPool("decode", config.decode, metrics)
    prefill = BackendPool("prefill", config.prefill, metrics) if config.prefill else None
    handoff_cls = None if config.colocated else handoff_class(config.handoff)
    state = ProxyState(
        config=config, metrics=metrics, decode=decode, prefill=prefill, handoff_cls=handoff_cls,
        router=Router(config.routing, prefill, decode, metrics,
                      local=handoff_cls is None or handoff_cls.serves_local),
        api_key_hash=hashlib.sha256(config.api_key.encode()).digest() if config.api_key else None)
    app = web.Application(middlewares=[_front_door], client_max_size=config.max_body_bytes)
    app[STATE] = state
    app.cleanup_ctx.append(_lifecycle)
    app.on_response_prepare.append(_note_replaced_id)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.router.add_post(COMPLETIONS, _generate)
    app.router.add_post(CHAT, _generate)
    for method, path in forwarded_routes():
        app.router.add_route(method, path, _forward)
    return app


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    """Client session, handoff and health probes for as long as the app runs."""
    state = app[STATE]
    t = state.config.timeouts
    session = make_session(t)
    state.upstream = Upstream(session, t, state.metrics, engine_key=state.config.engine_key)
    if state.prefill is not None and state.handoff_cls is not None:
        try:  # a handoff checks its options and may bind sockets
            state.handoff = state.handoff_cls(state.upstream, state.prefill, state.decode, state.metrics,
                                              options=dict(state.config.handoff_options))
        except BaseException:
            await session.close()
            raise
    pools = [p for p in (state.prefill, state.decode) if p is not None]
    prober = HealthProber(pools, session, t.health_interval, t.health_timeout)
    await prober.probe_all()
    probing = asyncio.create_task(prober.run(), name="disagg-proxy-health")
    try:
        yield
    finally:
        probing.cancel()
        with suppress(asyncio.CancelledError):
            await probing
        if state.handoff is not None:
            await state.handoff.aclose()
        state.handoff = None
        state.upstream = None
        await session.close()


def _authorized(state: ProxyState, request: web.Request) -> bool:
    if state.api_key_hash is None or request.method == "OPTIONS" or not request.path.startswith(GUARDED_PREFIXES):
        return True
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    return secrets.compare_digest(hashlib.sha256(token.strip().encode()).digest(), state.api_key_hash)


#: CORS preflight answer, as vLLM's (Starlette's) CORS middleware gives it with its
#: defaults (any origin, any method, any header, no credentials)
CORS_METHODS = "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT"
CORS_MAX_AGE = "600"


def _preflight(request: web.Request, headers: dict[str, str]) -> web.Response:
    """``OPTIONS``: answered here, never forwarded (an engine only ever sees the proxy's requests).

    A CORS preflight (``Origin`` and ``Access-Control-Request-Method``) gets 200 with the
    allow headers; any other ``OPTIONS`` gets 405, as from vLLM.
    """
    if "Origin" not in request.headers or "Access-Control-Request-Method" not in request.headers:
        return error_response(405, f"Method Not Allowed: OPTIONS {request.path}", headers)
    cors = {**headers, "Access-Control-Allow-Origin": "*", "Access-Control-Allow-Methods": CORS_METHODS,
            "Access-Control-Max-Age": CORS_MAX_AGE}
    if wanted := request.headers.get("Access-Control-Request-Headers"):
        cors["Access-Control-Allow-Headers"] = wanted
    return web.Response(status=200, text="OK", headers=cors)


@web.middleware
async def _front_door(request: web.Request,
                      handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """The path check, request id, OPTIONS, API key, the body read within its timeout, and every
    error as an OpenAI error body. The handlers take their concurrency slots once the body is in."""
    request_id, replaced = request_id_of(request)
    request[REQUEST_ID_KEY] = request_id
    if replaced is not None:
        request[REQUEST_ID_NOTE_KEY] = f"the client's X-Request-Id is {replaced}; engines saw this one"
    headers = {REQUEST_ID: request_id}
    try:
        if problem := path_problem(request.raw_path):
            request.app[STATE].metrics.rejected.labels("path").inc()
            raise NotFound(f"Not Found: {problem}")
        if request.method == "OPTIONS":
            return _preflight(request, headers)
        state = request.app[STATE]
        if not _authorized(state, request):
            raise Unauthorized("invalid or missing API key (send Authorization: Bearer KEY)")
        if request.body_exists and request.match_info.http_exception is None:
            size = min(request.content_length or state.config.max_body_bytes, state.config.max_body_bytes)
            with state.reading.take(size):
                await read_body(request, state.config.timeouts.client_body)
        out = await handler(request)
        if isinstance(out, web.Response) and not out.prepared:  # a whole reply: sent within timeouts.send too
            send = state.config.timeouts.send
            await send_within(request, out.prepare(request), send)
            await send_within(request, out.write_eof(), send)
        return out
    except ProxyHTTPError as exc:
        return exc.response(headers)
    except EngineErrorReply as exc:
        return web.Response(status=exc.status, body=exc.body, headers=downstream_headers(exc.headers, request_id))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(exc.status, f"{exc.reason}: {request.method} {request.path}", headers)
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception as exc:
        log.exception("proxy error on %s %s", request.method, request.path)
        return error_response(500, f"proxy internal error: {exc.__class__.__name__}: {exc}", headers)


async def _note_replaced_id(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: every reply (streams and errors too) to a client whose
    ``X-Request-Id`` was replaced says so in :data:`REQUEST_ID_REPLACED`."""
    note = request.get(REQUEST_ID_NOTE_KEY)
    if note is not None:
        response.headers[REQUEST_ID_REPLACED] = note


async def _health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    pools = [p for p in (state.prefill, state.decode) if p is not None]
    report = {p.role: {b.url: ("healthy" if b.healthy else b.last_error) for b in p.backends} for p in pools}
    missing = [p.role for p in pools if not p.healthy()]
    if missing:
        what = " and ".join(f"no healthy {role} instance" for role in missing)
        detail = "; ".join(p.describe() for p in pools)
        return NoHealthyBackend(f"{what}: {detail}").response({REQUEST_ID: request[REQUEST_ID_KEY]})
    return web.json_response({"status": "ok", **report}, headers={REQUEST_ID: request[REQUEST_ID_KEY]})


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def _forward(request: web.Request) -> web.StreamResponse:
    """Any other engine route: unchanged to a decode instance."""
    state = request.app[STATE]
    upstream = state.client()
    rid: str = request[REQUEST_ID_KEY]
    data = _without_kv_params(await request.read(), rid) if request.body_exists else None
    with state.slots.take():
        async with upstream.request(state.decode, request.method, request.raw_path, data=data,
                                    headers=upstream_headers(request.headers, rid)) as (backend, resp):
            if is_event_stream(resp):
                return await relay_stream(request, upstream, backend, resp, rid, StreamTiming(time.perf_counter()))
            return await relay_whole(upstream, backend, resp, rid)


def _json_object(raw: bytes) -> dict[str, Any] | None:
    """``raw`` as a JSON object, or None when it is not one (unreadable, nested too deeply,
    another JSON type). vLLM parses bodies with the same ``json`` module, so what fails
    here fails there too, and carries no KV instructions to an engine."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    return body if isinstance(body, dict) else None


def _without_kv_params(raw: bytes, rid: str) -> bytes:
    """A pass-through body without client ``kv_transfer_params``, when it is a JSON object
    (other bodies go as they are: an engine reads no KV instructions from them)."""
    body = _json_object(raw)
    if body is None:
        return raw
    body, stripped = strip_kv_params(body)
    if not stripped:
        return raw
    log.info("request %s: removed client-supplied kv_transfer_params", rid)
    return json.dumps(body).encode()


def _samples(body: Mapping[str, Any]) -> int:
    n = body.get("n")
    return n if isinstance(n, int) and n > 0 else 1


async def _open_reply(state: ProxyState, route: PromptRoute, stack: AsyncExitStack, *,
                      first_token_seen: bool) -> DecodeReply:
    """Decode's reply for one route, entered on ``stack``: through the handoff (``split``),
    from a prefill engine alone (``whole``), or from decode alone (``local``, and ``split``
    or ``whole`` when the prefill side failed and fallback allows); sets ``route.served``.
    ``first_token_seen``: the router will be told of its first token (a streamed single-prompt
    reply; a batch's prompts and a reply not streamed count until their predicted end)."""
    req = route.request
    route.sent(first_token_seen)
    if route.path is RoutePath.WHOLE and state.prefill is not None:
        try:
            backend, resp = await stack.enter_async_context(
                state.client().request(state.prefill, "POST", req.endpoint, data=req.raw, headers=req.headers,
                                       prefer=route.prefill))
            route.prefill = backend
            route.served = Served.WHOLE
            return DecodeReply(backend, resp)
        except NoHealthyBackend as exc:  # every prefill engine refused the connection, or none is healthy
            log.warning("request %s: %s; decode serves it", req.request_id, exc.message)
            state.metrics.fallbacks.labels("no_healthy_prefill").inc()
            route.served = Served.FALLBACK
    elif route.path is RoutePath.SPLIT and state.handoff is not None:
        try:
            reply = await stack.enter_async_context(state.handoff.serve(route))
            route.served = Served.SPLIT
            return reply
        except PrefillFailed as exc:
            if state.config.fallback == "never":
                raise PrefillUnavailable(f"{exc.message}; fallback is 'never', so decode does not "
                                         "serve the request alone") from exc
            # a missing prefill pool is logged once, by the health prober
            level = logging.DEBUG if exc.reason == "no_healthy_prefill" else logging.WARNING
            log.log(level, "request %s: %s; decode serves it alone", req.request_id, exc.message)
            state.metrics.fallbacks.labels(exc.reason).inc()
            route.served = Served.FALLBACK
    elif route.reason == "colocated":
        route.served = Served.COLOCATED
    else:
        route.served = Served.LOCAL
        state.metrics.local_routes.labels(route.reason).inc()
    backend, resp = await stack.enter_async_context(
        state.client().request(state.decode, "POST", req.endpoint, data=req.raw, headers=req.headers,
                               prefer=route.decode))
    route.decode = backend
    return DecodeReply(backend, resp)


def _route_header(plan: RequestPlan) -> dict[str, str]:
    """``X-Disagg-Route``, once every route is open: per prompt the path that serves it, or
    ``fallback`` where the prefill side failed and a decode engine serves the prompt alone."""
    return {ROUTE_HEADER: ", ".join(r.taken for r in plan.routes)}


def _request_path(plan: RequestPlan) -> str:
    """The ``requests_total`` path label of a served request: how its routes were served
    (``fallback`` or ``local`` if any route was, else the routes' common label)."""
    served = {r.served for r in plan.routes}
    for label in (Served.FALLBACK, Served.LOCAL, Served.WHOLE):
        if label in served:
            return label.value
    one = served.pop() if len(served) == 1 else Served.SPLIT
    return (one or Served.SPLIT).value


def _client_request(request: web.Request, raw: bytes, decode_answers_errors: bool) -> GenerationRequest:
    """The client's generation request as engines may see it: without client ``kv_transfer_params``.

    A body that is not a JSON object goes to the decode engine as it is (``parsed`` false), so the
    client gets a single server's own error for it; where decode engines cannot serve alone
    (``decode_answers_errors`` false) the proxy answers 400 itself.
    """
    rid: str = request[REQUEST_ID_KEY]
    headers = upstream_headers(request.headers, rid)
    headers["Content-Type"] = "application/json"  # the body is JSON, whatever the client labelled it
    parsed = _json_object(raw)
    if parsed is None:
        if not decode_answers_errors:
            raise BadRequest("request body is not a JSON object")
        return GenerationRequest(endpoint=request.path, body={}, encoded=raw, headers=headers, request_id=rid,
                                 parsed=False)
    body, stripped = strip_kv_params(parsed)
    if stripped:
        log.info("request %s: removed client-supplied kv_transfer_params", rid)
        raw = json.dumps(body).encode()
    return GenerationRequest(endpoint=request.path, body=body, encoded=raw, headers=headers, request_id=rid)


async def _generate(request: web.Request) -> web.StreamResponse:
    """Completions and chat: one route per prompt (prefill -> decode, or decode alone), replies joined."""
    started = time.perf_counter()
    state = request.app[STATE]
    metrics = state.metrics
    local = state.handoff is None or state.handoff.serves_local
    req = _client_request(request, await request.read(), local)
    try:
        plan = plan_request(req, split=state.handoff is not None, local=local, max_prompts=state.config.max_prompts)
    except TooManyPrompts as exc:
        metrics.rejected.labels("max_prompts").inc()
        raise BadRequest(str(exc), param="prompt") from None
    parallel = batch_parallelism(plan, state.config.max_concurrency)
    with state.slots.take(parallel):
        return await _serve_plan(request, state, plan, parallel, started)


async def _serve_plan(request: web.Request, state: ProxyState, plan: RequestPlan, parallel: int,
                      started: float) -> web.StreamResponse:
    """Serve ``plan`` (its slots taken): routing, then one reply or a batch's joined replies."""
    metrics, upstream, req = state.metrics, state.client(), plan.request
    rid = req.request_id
    state.router.route(plan, started)
    label = "chat" if req.endpoint == CHAT else "completions"
    path = "error"
    try:
        timing = StreamTiming(started)
        if plan.batched:
            out = await serve_batch(request, plan,
                                    lambda route, stack: _open_reply(state, route, stack, first_token_seen=False),
                                    upstream, timing, max_parallel=parallel, extra=lambda: _route_header(plan))
            if out.status == 200 and not timing.broken:
                path = _request_path(plan)
                if req.stream:
                    observe_stream(metrics, timing, None, len(plan.routes))
            return out
        async with AsyncExitStack() as stack:
            route = plan.routes[0]
            timing.on_first = route.first_token
            reply = await _open_reply(state, route, stack, first_token_seen=req.stream)
            routed = _route_header(plan)
            resp = reply.response
            if resp.status != 200:
                timing.on_first = None
            elif req.stream and _samples(req.body) == 1:
                route.watch(timing)
            if is_event_stream(resp):
                out = await relay_stream(request, upstream, reply.backend, resp, rid, timing, routed,
                                         reply.id_suffix.encode())
                if not timing.broken and resp.status == 200:
                    choices = _samples(req.body)
                    observe_stream(metrics, timing, reply.prefill_done, choices)
                    if choices == 1 and timing.first is not None and timing.last is not None:
                        route.decoded(reply.backend, timing.token_events, timing.first, timing.last)
            else:
                out = await relay_whole(upstream, reply.backend, resp, rid, routed, reply.id_suffix.encode())
            await reply.settle()
            if resp.status == 200 and not timing.broken:
                path = _request_path(plan)
        return out
    finally:
        for route in plan.routes:
            route.finished()
        metrics.requests.labels(label, path).inc()
        metrics.e2e.observe(time.perf_counter() - started)
