"""ProxyServer lifecycle and the event loop choice."""

from __future__ import annotations

import sys

import pytest

from disagg.errors import ProxyError
from disagg.proxy import ProxyConfig, ProxyServer
from disagg.proxy.server import loop_factory


async def test_server_states(standin) -> None:
    d = await standin("D")
    server = ProxyServer(ProxyConfig(decode=(d.url,), port=0))
    with pytest.raises(ProxyError, match="not listening"):
        _ = server.url
    async with server:
        assert server.url.startswith("http://127.0.0.1:") and server.port
        with pytest.raises(ProxyError, match="is running"):
            await server.start()
    await server.aclose()  # idempotent
    with pytest.raises(ProxyError, match="is closed"):
        await server.start()


async def test_port_in_use_names_the_address(standin) -> None:
    d = await standin("D")
    async with ProxyServer(ProxyConfig(decode=(d.url,), port=0)) as first:
        second = ProxyServer(ProxyConfig(decode=(d.url,), port=first.port))
        with pytest.raises(ProxyError, match=f"cannot listen on 127.0.0.1:{first.port}"):
            await second.start()


def test_loop_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    assert loop_factory("asyncio") is None
    monkeypatch.setitem(sys.modules, "uvloop", None)  # as if not installed
    assert loop_factory("auto") is None
    with pytest.raises(ProxyError, match="uvloop is not installed"):
        loop_factory("uvloop")
    with pytest.raises(ProxyError, match="loop must be one of"):
        loop_factory("trio")
