"""The proxy's errors, the OpenAI error body, and the one place where aiohttp
client exceptions become proxy errors.

::

    ProxyError (disagg.errors)          bad proxy configuration (the CLI prints it; nothing starts)

    ProxyHTTPError                      an error one client request ends with; carries its status
        ├── BadRequest                  400: unreadable client request, too many prompts
        ├── Unauthorized                401: missing or wrong API key
        ├── NotFound                    404: a path the proxy does not serve
        ├── RequestTimeout              408: the body did not arrive in time
        ├── RetryLater                  an error that passes (Retry-After)
        │   ├── TooManyRequests         429: over the concurrency cap
        │   └── NoHealthyBackend        503: no healthy instance of a role
        ├── PrefillUnavailable          503: prefill failed and fallback is "never"
        └── UpstreamError               an engine could not be used
            ├── UpstreamConnectError    502: connection refused / reset before sending
            ├── UpstreamDisconnected    502: the engine closed the connection mid-reply
            ├── UpstreamTimeout         504: no reply (or next chunk) in time
            └── UpstreamBadReply        502: a reply the proxy cannot use

Every body the proxy writes itself has vLLM's (= OpenAI's) shape:
``{"error": {"message", "type", "param", "code"}}``. Errors an engine returns
are relayed with the engine's own status and body, not rewritten.
"""

from __future__ import annotations

import json
from http import HTTPStatus

import aiohttp
from aiohttp import web

#: OpenAI/vLLM error ``type`` for each status the proxy produces itself
_ERROR_TYPES: dict[int, str] = {
    400: "BadRequestError",
    401: "AuthenticationError",
    429: "RateLimitError",
    404: "NotFoundError",
    408: "RequestTimeoutError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def error_type(status: int) -> str:
    """The error ``type`` string for an HTTP status (vLLM's naming)."""
    return _ERROR_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"


def error_body(status: int, message: str, param: str | None = None) -> dict[str, object]:
    """An OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": status}}


def error_response(status: int, message: str, headers: dict[str, str] | None = None,
                   param: str | None = None) -> web.Response:
    """A JSON response carrying :func:`error_body`."""
    return web.Response(status=status, body=json.dumps(error_body(status, message, param)).encode(),
                        content_type="application/json", headers=headers)


def sse_error_event(status: int, message: str) -> bytes:
    """The error event vLLM writes when a stream fails after it started, then ``[DONE]``."""
    return b"data: " + json.dumps(error_body(status, message)).encode() + b"\n\ndata: [DONE]\n\n"


class ProxyHTTPError(Exception):
    """An error that ends one client request with ``status`` (never a configuration error);
    the app's error middleware turns it into the response."""

    status: int = 500

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def response(self, headers: dict[str, str] | None = None) -> web.Response:
        """This error as an OpenAI error response."""
        return error_response(self.status, self.message, headers, self.param)


class BadRequest(ProxyHTTPError):
    status = 400


class NotFound(ProxyHTTPError):
    """A path the proxy does not serve (or refuses to read: dot segments)."""

    status = 404


class RequestTimeout(ProxyHTTPError):
    """The client did not send its whole body within ``timeouts.client_body``."""

    status = 408


class Unauthorized(ProxyHTTPError):
    status = 401


class RetryLater(ProxyHTTPError):
    """An error that passes: the response carries ``Retry-After`` (seconds)."""

    #: the ``Retry-After`` the client is given, seconds
    retry_after_s = 1

    def response(self, headers: dict[str, str] | None = None) -> web.Response:
        return error_response(self.status, self.message, {**(headers or {}),
                                                          "Retry-After": str(self.retry_after_s)}, self.param)


class TooManyRequests(RetryLater):
    status = 429


class NoHealthyBackend(RetryLater):
    """No instance of a role is in service (every decode engine down, or restarting under
    ``disagg up``'s supervision): 503 with ``Retry-After``, the time of about one health probe
    round, after which a restarted engine is back in service."""

    status = 503
    retry_after_s = 2


class PrefillUnavailable(ProxyHTTPError):
    status = 503


class UpstreamError(ProxyHTTPError):
    """An engine could not be used; ``url`` names it, ``retryable`` says the
    request never reached it (safe to send elsewhere)."""

    status = 502
    retryable = False
    #: short label for metrics
    kind = "error"

    def __init__(self, url: str, message: str) -> None:
        super().__init__(f"{url}: {message}")
        self.url = url


class UpstreamConnectError(UpstreamError):
    status = 502
    retryable = True
    kind = "connect"


class UpstreamDisconnected(UpstreamError):
    status = 502
    kind = "disconnected"


class UpstreamTimeout(UpstreamError):
    status = 504
    kind = "timeout"


class UpstreamBadReply(UpstreamError):
    status = 502
    kind = "bad_reply"


def map_client_error(exc: BaseException, url: str, timeout_s: float | None = None) -> UpstreamError:
    """The :class:`UpstreamError` for a low-level exception raised while talking to ``url``.

    The only place aiohttp/OS exceptions are translated; callers ``raise
    map_client_error(exc, url) from exc``.
    """
    what = _describe(exc)
    if isinstance(exc, aiohttp.ClientConnectorError | ConnectionRefusedError):
        return UpstreamConnectError(url, f"cannot connect ({what})")
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return UpstreamConnectError(url, f"connection not established within {timeout_s}s")
    if isinstance(exc, TimeoutError):  # includes aiohttp.ServerTimeoutError
        limit = f" within {timeout_s}s" if timeout_s is not None else ""
        return UpstreamTimeout(url, f"no reply{limit} (request timeout)")
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError
                   | aiohttp.ClientConnectionError | ConnectionError):
        return UpstreamDisconnected(url, f"connection lost ({what})")
    if isinstance(exc, aiohttp.ClientResponseError | json.JSONDecodeError | UnicodeDecodeError | ValueError):
        return UpstreamBadReply(url, f"unreadable reply ({what})")
    if isinstance(exc, aiohttp.ClientError):
        return UpstreamBadReply(url, f"request failed ({what})")
    return UpstreamBadReply(url, f"unexpected {what}")


def _describe(exc: BaseException) -> str:
    """``Class: message``, safe for exceptions built without arguments."""
    try:
        text = str(exc)
    except Exception:
        text = ""
    return f"{exc.__class__.__name__}: {text}" if text else exc.__class__.__name__


#: exceptions the upstream boundary catches and hands to :func:`map_client_error`
CLIENT_ERRORS: tuple[type[BaseException], ...] = (
    aiohttp.ClientError, TimeoutError, ConnectionError, json.JSONDecodeError, UnicodeDecodeError)
