"""Fixtures of the proxy tests: stand-in engines, proxies, an HTTP client."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from proxy_standin import FAST, StandInEngine

from disagg.proxy import ProxyConfig, ProxyServer


@pytest.fixture
async def standin() -> AsyncIterator[Callable[..., Awaitable[StandInEngine]]]:
    """Factory of started stand-in engines, all stopped after the test."""
    made: list[StandInEngine] = []

    async def make(name: str, **kw: Any) -> StandInEngine:
        engine = StandInEngine(name, **kw)
        await engine.start()
        made.append(engine)
        return engine

    yield make
    for engine in made:
        await engine.stop()


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
