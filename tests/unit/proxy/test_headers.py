"""Hop-by-hop headers and the client's credentials never cross the proxy; X-Request-Id always does."""

from __future__ import annotations

from multidict import CIMultiDict

from disagg.proxy.headers import HOP_BY_HOP, downstream_headers, upstream_headers


def test_hop_by_hop_is_the_rfc_set() -> None:
    assert isinstance(HOP_BY_HOP, frozenset)
    assert HOP_BY_HOP == {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                          "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade"}


def test_upstream_drops_hop_by_hop_and_connection_listed() -> None:
    client = CIMultiDict({"Connection": "keep-alive, X-Private", "Keep-Alive": "timeout=5", "X-Private": "1",
                          "Transfer-Encoding": "chunked", "TE": "trailers", "Host": "proxy:8000",
                          "Content-Length": "10", "Authorization": "Bearer k", "User-Agent": "openai",
                          "X-Request-Id": "old"})
    out = upstream_headers(client, "rid-1")
    assert dict(out) == {"User-Agent": "openai", "X-Request-Id": "rid-1"}


def test_upstream_never_carries_the_clients_credentials() -> None:
    client = CIMultiDict([("authorization", "Bearer client-key"), ("AUTHORIZATION", "Basic dTpw"),
                          ("Proxy-Authorization", "Basic cDpx"), ("Content-Type", "application/json")])
    out = upstream_headers(client, "rid-3")
    assert "Authorization" not in out and "Proxy-Authorization" not in out
    assert dict(out) == {"Content-Type": "application/json", "X-Request-Id": "rid-3"}


def test_downstream_keeps_end_to_end_headers() -> None:
    engine = CIMultiDict({"Content-Type": "text/event-stream", "Transfer-Encoding": "chunked",
                          "Connection": "close", "Content-Length": "5", "Date": "x", "Server": "uvicorn",
                          "X-Custom": "y"})
    out = downstream_headers(engine, "rid-2")
    assert dict(out) == {"Content-Type": "text/event-stream", "X-Custom": "y", "X-Request-Id": "rid-2"}
