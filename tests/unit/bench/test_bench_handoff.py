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
    proxy.routes, proxy.split_from, proxy.route_reason = ProxyMetrics(), split_from, "policy"
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


async def test_nothing_is_measured_unless_the_proxy_split_every_probe_by_its_policy(standin_factory) -> None:
    proxy, engine = await _pair(standin_factory, split_from=10_000)      # routes every probe local
    assert await probe_handoff_fixed(proxy.url, engine.url, "tiny", 2, per_byte_s=0.0) is None
    chosen, engine1 = await _pair(standin_factory, split_from=1)
    chosen.route_reason = "predicted"                                     # an auto proxy splitting them all
    assert await probe_handoff_fixed(chosen.url, engine1.url, "tiny", 2, per_byte_s=0.0) is None
    plain, engine2 = await _pair(standin_factory, split_from=1)
    plain.routes = None                                                   # no routing metrics at all
    assert await probe_handoff_fixed(plain.url, engine2.url, "tiny", 2, per_byte_s=0.0) is None


SPLIT_PAIR = """name: pair
run_dir: {run_dir}
model: {{path: disagg:tiny}}
engine: vllm
connector: socket
link: {{type: loopback}}
proxy: {{host: 127.0.0.1, port: {proxy_port}}}
hosts:
  p: {{address: 127.0.0.1, device: cpu}}
  d: {{address: 127.0.0.2, device: cpu}}
roles:
  prefill:
    - {{host: p, port: {engine_port}, kv_port: 18998}}
  decode:
    - {{host: d, port: 18200, kv_port: 18997}}
"""


async def test_a_pair_probed_at_two_lengths_stores_the_line_through_them(standin_factory, tmp_path) -> None:
    """``probe_handoff`` at the probe's length and the workload's longest: the stand-in proxy's split
    answers 20 ms + 1 ms per 50 prompt tokens later than P alone, so the stored line is a 20 ms fixed
    cost plus what 50 tokens' wire bytes take per ms; a long length too close to the short one
    (or none) stores the fixed cost alone, as before."""
    from disagg.bench.compare import TopologyUnderTest, handoff_words, probe_handoff
    from disagg.measurements import lookup_handoff
    from disagg.planning import plan_topology
    from disagg.topology import load_topology

    proxy, engine = await _pair(standin_factory, split_from=1)
    engine.base_ttft, proxy.base_ttft, proxy.prefill_tokens_per_s = 0.010, 0.030, 50_000.0
    file = tmp_path / "pair.yaml"
    file.write_text(SPLIT_PAIR.format(run_dir=tmp_path / "run", proxy_port=proxy.url.rsplit(":", 1)[1],
                                      engine_port=engine.url.rsplit(":", 1)[1]))
    t = TopologyUnderTest.load(file)
    assert t.handoff_pair is not None and t.handoff_pair[2] == engine.url
    found = await probe_handoff(t, t.handoff_pair, 1, 0, "ek", long_tokens=1024)
    assert found["stored"] is True and set(found["split_minus_prefill_s"]) == {"128", "1024"}
    stored = lookup_handoff(tmp_path / "run", "tiny", "p", "d", "socket", streaming=True)
    assert stored is not None and stored.exposed_per_byte_s is not None and len(stored.points) == 2
    wire_per_token = plan_topology(load_topology(file), [1000], 0).classes[0].kv_bytes / 1000
    assert stored.fixed_s == pytest.approx(0.020, abs=0.008)                      # scheduling: a few ms
    assert stored.exposed_per_byte_s == pytest.approx(1 / (50_000 * wire_per_token), rel=0.3)
    assert "128 tokens" in stored.source and "1,024 tokens" in stored.source
    assert " ms per MiB of KV, stored" in handoff_words(found)
    # seven measured pairs at each length (the probe's least), each after a warm-up pair
    assert len(engine.bodies) == len(proxy.bodies) == 16
    modelled = plan_topology(load_topology(file), [128], 0, use_measured_handoff=False)
    kv_part = modelled.classes[0].handoff_s - modelled.link.fixed_s
    for long_tokens in (None, 256):
        again = await probe_handoff(t, t.handoff_pair, 1, 0, "ek", long_tokens=long_tokens)
        assert again["stored"] is True and again["exposed_per_byte_s"] is None
        one = lookup_handoff(tmp_path / "run", "tiny", "p", "d", "socket", streaming=True)
        assert one is not None and one.exposed_per_byte_s is None and one.points == ()
        assert one.fixed_s == pytest.approx(0.020 + 128 / 50_000 - kv_part, abs=0.008)  # the KV as plan prices it
