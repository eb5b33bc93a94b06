"""Fixtures of the proxy tests: stand-in engines, proxies, an HTTP client."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any

import aiohttp
import pytest
from proxy_standin import FAST, StandInEngine

from disagg.proxy import ProxyConfig, ProxyServer


@pytest.fixture
async def started() -> AsyncIterator[Callable[..., Awaitable[Any]]]:
    """Factory: ``await started(StandInClass, *args, **kw)`` makes a stand-in and starts it; every
    one is stopped after the test."""
    async with AsyncExitStack() as stopping:
        async def make(cls: Callable[..., Any], *args: Any, **kw: Any) -> Any:
            server = cls(*args, **kw)
            await server.start()
            stopping.push_async_callback(server.stop)
            return server

        yield make


@pytest.fixture
def standin(started: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[StandInEngine]]:
    """Factory of started stand-in engines, all stopped after the test."""
    async def make(name: str, **kw: Any) -> StandInEngine:
        engine: StandInEngine = await started(StandInEngine, name, **kw)
        return engine

    return make


@pytest.fixture
async def proxy() -> AsyncIterator[Callable[..., Awaitable[ProxyServer]]]:
    """Factory of started proxies on free ports (fast timeouts), closed after the test."""
    made: list[ProxyServer] = []

    async def make(prefill: list[str] | tuple[str, ...] = (), decode: list[str] | tuple[str, ...] = (),
                   **kw: Any) -> ProxyServer:
        kw.setdefault("timeouts", FAST)
        server = ProxyServer(ProxyConfig(prefill=tuple(prefill), decode=tuple(decode), port=0, **kw))
        await server.start()
        made.append(server)
        return server

    yield make
    for server in made:
        await server.aclose()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """A plain HTTP client for the tests."""
    async with aiohttp.ClientSession() as session:
        yield session
