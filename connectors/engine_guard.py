"""ASGI middleware for vLLM's API server: every route needs the run's engine key.

vLLM's own API key (``VLLM_API_KEY``, or ``--api-key``) guards only paths that
start with ``/v1``, ``/v2``, ``/inference`` and ``/cohere``
(``vllm/entrypoints/serve/middleware/authenticate.py``). Everything else stays
open to anyone who reaches the port: ``/invocations`` (SageMaker: a
completion by another name), ``/tokenize``, ``/detokenize``, ``/pooling``,
``/classify``, ``/score``, ``/rerank``, and with ``VLLM_SERVER_DEV_MODE`` the
admin routes (``/sleep``, ``/reset_prefix_cache``, ``/collective_rpc`` ...).
A request with a crafted ``kv_transfer_params`` can make a P/D engine hang or
die, so in a disagg deployment only the proxy may send requests at all.

:class:`EngineGuard` closes the rest. vLLM loads it by import path
(``--middleware disagg_connectors.engine_guard.EngineGuard``; a class is
added with ``app.add_middleware``, after vLLM's own middlewares, so it is the
outermost one and sees every request first). It reads the key from
``VLLM_API_KEY`` (``disagg up`` sets it to the run's engine key, through the
environment, never the command line) and answers 401 with vLLM's OpenAI-style
error body unless the request carries ``Authorization: Bearer <key>``,
except:

- ``GET``/``HEAD`` of exactly ``/health``, ``/ping``, ``/metrics``,
  ``/version`` and ``/load``: read-only probes for the launcher, the proxy's
  health prober and metric scrapers;
- ``OPTIONS`` (CORS preflight; vLLM's key leaves it open too).

Decisions use the path the router matches (``scope["path"]``, already
percent-decoded, minus ``root_path``) and an allow-list of exact paths, so
``//invocations``, ``/Invocations`` or ``/health/../invocations`` cannot
sneak past: anything that is not literally an open probe needs the key.
WebSocket handshakes (``/v1/realtime``) need it too.

Without ``VLLM_API_KEY`` the guard lets everything through (as vLLM does
without a key) and says so once in the engine's log. Nothing here imports
``disagg`` or the engine: the module runs wherever the engine runs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

#: the variable the key is read from (vLLM's own, so its middleware guards /v1 with the same key)
KEY_ENV = "VLLM_API_KEY"
#: paths that answer GET/HEAD without the key
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version", "/load"})
OPEN_METHODS = frozenset({"GET", "HEAD"})

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

log = logging.getLogger(__name__)

_BODY = json.dumps({"error": {
    "message": "this engine answers only its proxy: send 'Authorization: Bearer <engine key>' "
               "(disagg up: DISAGG_ENGINE_KEY)",
    "type": "AuthenticationError", "param": None, "code": 401}}).encode()
_HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(_BODY)).encode()),
            (b"www-authenticate", b"Bearer")]


def route_path(scope: Scope) -> str:
    """The path the router matches: ``scope["path"]`` without ``root_path`` (Starlette's rule)."""
    path: str = scope.get("path", "")
    root: str = scope.get("root_path", "") or ""
    if root and path.startswith(root) and (path == root or path[len(root)] == "/"):
        return path[len(root):]
    return path


def bearer_token(scope: Scope) -> str | None:
    """The token of the first ``Authorization: Bearer ...`` header, or None."""
    for name, value in scope.get("headers") or ():
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token if scheme.lower() == "bearer" else None
    return None


class EngineGuard:
    """Pure ASGI middleware: 401 for every request without the engine key, except open probes."""

    def __init__(self, app: ASGIApp, key: str | None = None) -> None:
        self.app = app
        key = key if key is not None else os.environ.get(KEY_ENV)
        self._digest = hashlib.sha256(key.encode()).digest() if key else None
        if self._digest is None:
            log.warning("engine guard: %s is not set; every route is open to anyone who reaches this port",
                        KEY_ENV)

    def allowed(self, scope: Scope) -> bool:
        """True if ``scope`` may pass: no key configured, not HTTP/WebSocket, an open probe, or the key."""
        if self._digest is None or scope["type"] not in ("http", "websocket"):
            return True
        method = scope.get("method", "GET") if scope["type"] == "http" else None
        if method == "OPTIONS" or (method in OPEN_METHODS and route_path(scope) in OPEN_PATHS):
            return True
        token = bearer_token(scope)
        return token is not None and secrets.compare_digest(hashlib.sha256(token.encode()).digest(), self._digest)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.allowed(scope):
            await self.app(scope, receive, send)
        elif scope["type"] == "http":
            await send({"type": "http.response.start", "status": 401, "headers": _HEADERS})
            await send({"type": "http.response.body", "body": _BODY})
        elif "websocket.http.response" in (scope.get("extensions") or {}):
            await send({"type": "websocket.http.response.start", "status": 401, "headers": _HEADERS})
            await send({"type": "websocket.http.response.body", "body": _BODY})
        else:  # refuse the handshake (the server answers 403)
            await send({"type": "websocket.close", "code": 1008})
