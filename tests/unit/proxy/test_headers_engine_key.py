"""The engine key: every request the proxy sends to an engine carries ``Authorization: Bearer
<engine key>`` (when the proxy has one), never the client's own ``Authorization``."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from proxy_standin import FAST

from disagg.proxy.backends import Backend, BackendPool
from disagg.proxy.headers import upstream_headers
from disagg.proxy.metrics import ProxyMetrics
from disagg.proxy.upstream import Upstream, make_session

CLIENT = {"Authorization": "Bearer client-key", "Proxy-Authorization": "Basic cDpx",
          "Content-Type": "application/json", "User-Agent": "openai"}


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with make_session(FAST) as s:
        yield s


async def _send(upstream: Upstream, url: str, headers: dict[str, str]) -> None:
    resp = await upstream.send(Backend("decode", url), "POST", "/v1/embeddings", data=b"{}", headers=headers)
    assert resp.status == 200
    await resp.read()
    resp.release()


@pytest.mark.parametrize("headers", [upstream_headers(CLIENT, "rid-1"), CLIENT], ids=["filtered", "raw"])
async def test_send_carries_the_engine_key_and_nothing_of_the_client(standin, session, headers) -> None:
    engine = await standin("D")
    await _send(Upstream(session, FAST, ProxyMetrics(), engine_key="e-key"), engine.url, headers)
    (got,) = engine.received
    assert got.headers.getall("Authorization") == ["Bearer e-key"]
    assert "Proxy-Authorization" not in got.headers
    assert got.headers["User-Agent"] == "openai"


@pytest.mark.parametrize("headers", [upstream_headers(CLIENT, "rid-1"), CLIENT], ids=["filtered", "raw"])
async def test_without_an_engine_key_no_authorization_reaches_the_engine(standin, session, headers) -> None:
    engine = await standin("D")
    await _send(Upstream(session, FAST, ProxyMetrics()), engine.url, headers)
    (got,) = engine.received
    assert "Authorization" not in got.headers and "Proxy-Authorization" not in got.headers


async def test_pool_requests_carry_the_engine_key(standin, session) -> None:
    engine = await standin("D")
    metrics = ProxyMetrics()
    pool = BackendPool("decode", [engine.url], metrics)
    pool.backends[0].healthy = True
    upstream = Upstream(session, FAST, metrics, engine_key="e-key")
    async with upstream.request(pool, "GET", "/v1/models", data=None,
                                headers=upstream_headers(CLIENT, "rid-2")) as (_, resp):
        assert resp.status == 200
        await resp.read()
    assert [r.headers.get("Authorization") for r in engine.received] == ["Bearer e-key"]
    assert engine.received[0].headers["X-Request-Id"] == "rid-2"


async def test_the_proxy_sends_its_engine_key_on_every_engine_request(standin, proxy, http) -> None:
    p, d = await standin("P"), await standin("D")
    server = await proxy([p.url], [d.url], engine_key="e-key")
    client = {"Authorization": "Bearer client-key"}  # the proxy has no api_key: ignored, never forwarded
    async with http.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2},
                         headers=client) as resp:
        assert resp.status == 200
        await resp.read()
    async with http.get(server.url + "/v1/models", headers=client) as resp:
        assert resp.status == 200
    assert p.received and len(d.received) == 2
    assert [r.headers.get("Authorization") for r in p.received + d.received] == ["Bearer e-key"] * 3
