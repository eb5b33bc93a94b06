"""The routing policy inside the proxy app, against stand-in engines: the chosen path is the one
served, named in X-Disagg-Route and counted in disagg_route_total; ``whole`` sends the client's own
request to an idle prefill engine while the decode engine is backed up."""

from __future__ import annotations

import asyncio
import logging

import pytest
from proxy_standin import read_events, wait_for

from disagg.proxy.config import RoutingConfig

PROMPT = "word " * 40


def auto(**kw: float | bool) -> RoutingConfig:
    base: dict = {"policy": "auto", "kv_bytes_per_token": 1024.0, "prefill_tokens_per_s": 2000.0,
                  "link_bytes_per_s": 1e9, "handoff_fixed_s": 0.03}
    return RoutingConfig(**{**base, **kw})


def route_count(server, path: str, reason: str) -> float:  # type: ignore[no-untyped-def]
    value = server.app_state.metrics.registry.get_sample_value("disagg_route_total", {"path": path, "reason": reason})
    return value or 0.0


async def test_auto_serves_a_short_prompt_locally(standin, proxy, http) -> None:
    p, d = await standin("P"), await standin("D")
    server = await proxy(prefill=[p.url], decode=[d.url], routing=auto())
    async with http.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": PROMPT}) as resp:
        assert resp.status == 200 and resp.headers["X-Disagg-Route"] == "local"
        assert (await resp.json())["served_by"] == "D"
    assert p.generations() == [] and len(d.generations()) == 1
    assert "kv_transfer_params" not in d.generations()[0].body
    assert route_count(server, "local", "predicted") == 1
    reg = server.app_state.metrics.registry
    assert reg.get_sample_value("disagg_proxy_requests_total", {"endpoint": "completions", "path": "local"}) == 1
    assert reg.get_sample_value("disagg_route_predicted_ttft_seconds_count", {"path": "local"}) == 1


async def test_auto_splits_when_the_decode_engine_prefills_slowly(standin, proxy, http) -> None:
    p, d = await standin("P"), await standin("D")
    seeds = auto(decode_tokens_per_s=10.0, prefill_tokens_per_s=1e6)
    server = await proxy(prefill=[p.url], decode=[d.url], routing=seeds)
    async with http.post(server.url + "/v1/completions",
                         json={"model": "tiny", "prompt": PROMPT, "stream": True}) as resp:
        assert resp.status == 200 and resp.headers["X-Disagg-Route"] == "split"
        await read_events(resp)
    assert p.generations()[0].body["kv_transfer_params"]["do_remote_decode"] is True
    assert d.generations()[0].body["kv_transfer_params"]["remote_engine_id"] == "engine-P"
    assert route_count(server, "split", "predicted") == 1
    reg = server.app_state.metrics.registry
    assert reg.get_sample_value("disagg_route_observed_ttft_seconds_count", {"path": "split"}) == 1
    # the prediction's per-prompt error: |predicted - observed| / observed, one observation
    predicted = reg.get_sample_value("disagg_route_predicted_ttft_seconds_sum", {"path": "split"})
    observed = reg.get_sample_value("disagg_route_observed_ttft_seconds_sum", {"path": "split"})
    error = reg.get_sample_value("disagg_route_ttft_error_ratio_sum", {"path": "split"})
    assert reg.get_sample_value("disagg_route_ttft_error_ratio_count", {"path": "split"}) == 1
    assert error == pytest.approx(abs(predicted - observed) / observed)


async def test_whole_goes_to_the_idle_prefill_engine_while_decode_is_backed_up(standin, proxy, http) -> None:
    """A prompt of about 1,000 tokens at the seeded 2,000 tokens/s: the first goes local (0.5 s
    against a split's 0.53 s) and keeps decode's queue predicted busy for half a second, far
    longer than the second request takes to arrive even on a loaded machine (with a short prompt
    the queue drained in the predictor within ~25 ms, and a slow arrival went local too)."""
    p, d = await standin("P"), await standin("D")
    d.hang = True   # the first (local) request never gets its first token: decode is backed up
    server = await proxy(prefill=[p.url], decode=[d.url], routing=auto(whole=True))
    long_prompt = PROMPT * 20
    stuck = asyncio.create_task(http.post(server.url + "/v1/completions",
                                          json={"model": "tiny", "prompt": long_prompt, "stream": True}))
    await wait_for(lambda: d.running == 1)
    async with http.post(server.url + "/v1/completions",
                         json={"model": "tiny", "prompt": long_prompt, "stream": True}) as resp:
        assert resp.status == 200 and resp.headers["X-Disagg-Route"] == "whole"
        events = await read_events(resp)
    assert events[-1] == "[DONE]" and len(events) == p.tokens + 1
    assert len(p.generations()) == 1 and "kv_transfer_params" not in p.generations()[0].body
    assert route_count(server, "whole", "decode_backlog") == 1
    reg = server.app_state.metrics.registry
    assert reg.get_sample_value("disagg_proxy_requests_total", {"endpoint": "completions", "path": "whole"}) == 1
    stuck.cancel()
    await asyncio.gather(stuck, return_exceptions=True)


async def test_static_split_names_the_path_and_a_batch_names_each_prompt(standin, proxy, http) -> None:
    p, d = await standin("P"), await standin("D")
    server = await proxy(prefill=[p.url], decode=[d.url])
    async with http.post(server.url + "/v1/completions",
                         json={"model": "tiny", "prompt": ["a", "b"], "max_tokens": 2}) as resp:
        assert resp.status == 200 and resp.headers["X-Disagg-Route"] == "split, split"
    async with http.post(server.url + "/v1/completions",
                         json={"model": "tiny", "prompt": "a", "n": 2}) as resp:
        assert resp.status == 200 and resp.headers["X-Disagg-Route"] == "local"
    assert route_count(server, "split", "policy") == 2 and route_count(server, "local", "n") == 1


async def test_whole_falls_back_to_decode_when_the_prefill_engine_refuses(standin, proxy, http) -> None:
    """A prompt routed ``whole`` whose prefill engine died between two health probes: the decode
    engine serves it alone, and the header, the request's path and the fallback counter say so."""
    p, d = await standin("P"), await standin("D")
    d.hang = True   # the first (local) request backs decode up, as in the test above
    server = await proxy(prefill=[p.url], decode=[d.url], routing=auto(whole=True))
    long_prompt = PROMPT * 20
    stuck = asyncio.create_task(http.post(server.url + "/v1/completions",
                                          json={"model": "tiny", "prompt": long_prompt, "stream": True}))
    await wait_for(lambda: d.running == 1)
    d.hang = False  # later requests are answered
    await p.stop()  # dies between two probes: still healthy to the router, refusing connections
    async with http.post(server.url + "/v1/completions",
                         json={"model": "tiny", "prompt": long_prompt, "stream": True}) as resp:
        assert resp.status == 200 and resp.headers["X-Disagg-Route"] == "fallback"
        events = await read_events(resp)
    assert events[-1] == "[DONE]" and len(events) == d.tokens + 1
    assert route_count(server, "whole", "decode_backlog") == 1
    assert p.generations() == [] and len(d.generations()) == 2
    reg = server.app_state.metrics.registry
    assert reg.get_sample_value("disagg_proxy_requests_total", {"endpoint": "completions", "path": "fallback"}) == 1
    assert reg.get_sample_value("disagg_proxy_fallbacks_total", {"reason": "no_healthy_prefill"}) == 1
    stuck.cancel()
    await asyncio.gather(stuck, return_exceptions=True)


async def test_a_static_decision_is_logged_at_debug_level(standin, proxy, http, caplog) -> None:
    p, d = await standin("P"), await standin("D")
    server = await proxy(prefill=[p.url], decode=[d.url])
    with caplog.at_level(logging.DEBUG, logger="disagg.proxy"):
        async with http.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": ["a", "b"]},
                             headers={"X-Request-Id": "req-7"}) as resp:
            assert resp.status == 200
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("route req-7")]
    assert lines == ["route req-7-0 prompt 0 -> split (policy)", "route req-7-1 prompt 1 -> split (policy)"]
