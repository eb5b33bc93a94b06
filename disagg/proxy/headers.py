"""Which HTTP headers cross the proxy (RFC 9110 section 7.6.1)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from multidict import CIMultiDict

#: connection-scoped headers: never forwarded in either direction (lower case)
HOP_BY_HOP: frozenset[str] = frozenset({
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
})

#: also dropped towards an engine: the client library sets its own Host and
#: length, and the proxy may rewrite the body; the client's credentials are
#: for the proxy alone (``Upstream`` sends the engine key instead, if any)
_NOT_UPSTREAM: frozenset[str] = HOP_BY_HOP | {"host", "content-length", "expect", "authorization"}

#: also dropped towards the client: aiohttp writes its own framing and Date/Server
_NOT_DOWNSTREAM: frozenset[str] = HOP_BY_HOP | {"content-length", "date", "server"}

REQUEST_ID = "X-Request-Id"


def _connection_tokens(headers: Mapping[str, str]) -> set[str]:
    """Header names listed in ``Connection:`` are hop-by-hop too."""
    value = headers.get("Connection", "")
    return {token.strip().lower() for token in value.split(",") if token.strip()}


def _filter(headers: Mapping[str, str], drop: frozenset[str]) -> CIMultiDict[str]:
    extra = _connection_tokens(headers)
    items: Iterable[tuple[str, str]] = headers.items()
    return CIMultiDict((k, v) for k, v in items if k.lower() not in drop and k.lower() not in extra)


def upstream_headers(client_headers: Mapping[str, str], request_id: str) -> CIMultiDict[str]:
    """The client's end-to-end headers for an engine, with ``X-Request-Id`` set
    (never ``Authorization`` or ``Proxy-Authorization``)."""
    out = _filter(client_headers, _NOT_UPSTREAM)
    out[REQUEST_ID] = request_id
    return out


def downstream_headers(engine_headers: Mapping[str, str], request_id: str) -> CIMultiDict[str]:
    """An engine's end-to-end response headers for the client, with ``X-Request-Id`` set."""
    out = _filter(engine_headers, _NOT_DOWNSTREAM)
    out[REQUEST_ID] = request_id
    return out
