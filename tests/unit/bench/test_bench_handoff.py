"""The handoff probe (disagg.bench.prefill.probe_handoff_fixed): TTFT through a proxy that splits minus the same
prompts straight to the prefill engine, less the KV-sized part the plan prices. Stand-in servers
(tests/unit/bench/conftest.py), no engines."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from disagg.bench.prefill import HANDOFF_PROBE_TOKENS, probe_handoff_fixed
from disagg.proxy.metrics import ProxyMetrics


async def _pair(factory: Callable[[], Awaitable[Any]], split_from: int) -> tuple[Any, Any]:
    proxy, engine = await factory(), await factory()
    for s in (proxy, engine):
        s.model, s.prefill_tokens_per_s = "tiny", 1e9
    engine.base_ttft, proxy.base_ttft = 0.010, 0.070          # a split answers 60 ms later than P alone
    proxy.routes, proxy.split_from = ProxyMetrics(), split_from
    return proxy, engine


async def test_the_fixed_cost_is_the_split_s_extra_ttft_less_the_kv_part(standin_factory) -> None:
    proxy, engine = await _pair(standin_factory, split_from=1)
    found = await probe_handoff_fixed(proxy.url, engine.url, "tiny", 3, per_byte_s=0.015,
                                      engine_headers={"Authorization": "Bearer ek"})
    assert found is not None
    fixed, gap = found
    assert gap == pytest.approx(0.060, abs=0.015)             # scheduling on a loaded machine: a few ms
    assert fixed == pytest.approx(gap - 0.015)
    # one warm-up pair and three measured; each prompt its own, of the probe's length, max_tokens 1
    assert len(engine.bodies) == len(proxy.bodies) == 4
    assert all(b["max_tokens"] == 1 for b in engine.bodies + proxy.bodies)
    assert len({b["prompt"] for b in engine.bodies + proxy.bodies}) == 8
    assert engine.authorizations == ["Bearer ek"] * 4 and set(proxy.authorizations) == {None}
    assert HANDOFF_PROBE_TOKENS == 128


async def test_nothing_is_measured_unless_the_proxy_split_every_probe(standin_factory) -> None:
    proxy, engine = await _pair(standin_factory, split_from=10_000)      # routes every probe local
    assert await probe_handoff_fixed(proxy.url, engine.url, "tiny", 2, per_byte_s=0.0) is None
    plain, engine2 = await _pair(standin_factory, split_from=1)
    plain.routes = None                                                   # no routing metrics at all
    assert await probe_handoff_fixed(plain.url, engine2.url, "tiny", 2, per_byte_s=0.0) is None
