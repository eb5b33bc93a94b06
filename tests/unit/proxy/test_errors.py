"""Every low-level client exception maps to a proxy error with the right status."""

from __future__ import annotations

import json

import aiohttp
import pytest
from aiohttp.client_reqrep import ConnectionKey

from disagg.proxy.errors import (
    CLIENT_ERRORS,
    UpstreamBadReply,
    UpstreamConnectError,
    UpstreamDisconnected,
    UpstreamError,
    UpstreamTimeout,
    error_body,
    map_client_error,
    sse_error_event,
)

KEY = ConnectionKey("h", 1, False, True, None, None, None)
URL = "http://h:1"

CASES = [
    (aiohttp.ClientConnectorError(KEY, ConnectionRefusedError(111, "refused")), UpstreamConnectError, 502),
    (ConnectionRefusedError(111, "refused"), UpstreamConnectError, 502),
    (aiohttp.ConnectionTimeoutError("slow"), UpstreamConnectError, 502),
    (aiohttp.SocketTimeoutError("slow"), UpstreamTimeout, 504),
    (TimeoutError(), UpstreamTimeout, 504),
    (aiohttp.ServerDisconnectedError(), UpstreamDisconnected, 502),
    (aiohttp.ClientPayloadError("cut"), UpstreamDisconnected, 502),
    (aiohttp.ClientOSError(104, "reset"), UpstreamDisconnected, 502),
    (ConnectionResetError(104, "reset"), UpstreamDisconnected, 502),
    (json.JSONDecodeError("bad", "x", 0), UpstreamBadReply, 502),
    (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad"), UpstreamBadReply, 502),
    (aiohttp.InvalidURL("x"), UpstreamBadReply, 502),
]


@pytest.mark.parametrize(("exc", "cls", "status"), CASES, ids=lambda v: type(v).__name__)
def test_mapping(exc: BaseException, cls: type, status: int) -> None:
    assert isinstance(exc, CLIENT_ERRORS), "the boundary must catch it"
    err = map_client_error(exc, URL, 3.0)
    assert type(err) is cls and err.status == status and err.url == URL and err.message.startswith(URL)


def test_every_aiohttp_client_error_is_caught_and_mapped() -> None:
    def subclasses(cls: type) -> set[type]:
        return {cls} | {s for c in cls.__subclasses__() for s in subclasses(c)}

    classes = subclasses(aiohttp.ClientError) | {TimeoutError, ConnectionError}
    for cls in classes:
        assert issubclass(cls, CLIENT_ERRORS), f"{cls.__name__} escapes the boundary"
        err = map_client_error(cls.__new__(cls), URL)  # bare instance: mapping must not depend on arguments
        assert isinstance(err, UpstreamError) and err.status in (502, 504)
        assert "unexpected" not in err.message, f"{cls.__name__} has no deliberate mapping"


def test_error_body_shape() -> None:
    assert error_body(503, "down") == {"error": {"message": "down", "type": "ServiceUnavailableError",
                                                 "param": None, "code": 503}}
    assert error_body(405, "x")["error"]["type"] == "MethodNotAllowedError"


def test_sse_error_event_then_done() -> None:
    event = sse_error_event(502, "broke")
    first, second, rest = event.split(b"\n\n")
    assert json.loads(first.removeprefix(b"data: ")) == error_body(502, "broke")
    assert second == b"data: [DONE]" and rest == b""
