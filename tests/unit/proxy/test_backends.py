"""Pools: least outstanding with round-robin ties, health take-out and put-back."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from proxy_standin import FAST, wait_for

from disagg.proxy.backends import BackendPool, HealthProber, kv_capacity_tokens
from disagg.proxy.metrics import ProxyMetrics

# A probe's deadline wide enough that a stand-in answering at once never misses it on a loaded CI
# machine, and a late answer that always misses it (the probe is cut off at the deadline).
DEADLINE = 2.0
LATE = 60.0


def pool(n: int) -> BackendPool:
    p = BackendPool("decode", [f"http://h{i}:1" for i in range(n)], ProxyMetrics())
    for b in p.backends:
        p.mark_up(b)
    return p


def test_ties_go_round_robin() -> None:
    p = pool(3)
    assert [p.pick().url for _ in range(6)] == ["http://h0:1", "http://h1:1", "http://h2:1"] * 2


def test_least_outstanding_wins() -> None:
    p = pool(3)
    a, b, c = p.backends
    with p.lease(a), p.lease(a), p.lease(b):
        assert p.pick() is c
        with p.lease(c), p.lease(c):
            assert p.pick() is b
    assert (a.outstanding, b.outstanding, c.outstanding) == (0, 0, 0)


def test_unhealthy_and_excluded_are_skipped() -> None:
    p = pool(2)
    a, b = p.backends
    p.mark_down(a, "probe failed")
    assert [p.pick() for _ in range(3)] == [b, b, b]
    assert p.pick(exclude=[b]) is None
    p.mark_up(a)
    assert p.pick(exclude=[b]) is a


def test_lease_tracks_in_flight_gauge() -> None:
    metrics = ProxyMetrics()
    p = BackendPool("prefill", ["http://h:1"], metrics)
    [a] = p.backends
    labels = {"role": "prefill", "url": "http://h:1"}
    with p.lease(a):
        assert metrics.registry.get_sample_value("disagg_proxy_backend_in_flight", labels) == 1
    assert metrics.registry.get_sample_value("disagg_proxy_backend_in_flight", labels) == 0


async def test_proxy_balances_colocated_servers(standin, proxy, http) -> None:
    a = await standin("A")
    b = await standin("B")
    server = await proxy(decode=[a.url, b.url])
    served = []
    for _ in range(4):
        async with http.post(server.url + "/v1/completions", json={"prompt": "x"}) as resp:
            served.append((await resp.json())["served_by"])
    assert served == ["A", "B", "A", "B"]


async def test_busy_server_gets_no_new_request(standin, proxy, http) -> None:
    gate = asyncio.Event()
    a = await standin("A", gate=gate, tokens=2)
    b = await standin("B")
    server = await proxy(decode=[a.url, b.url])
    slow = await http.post(server.url + "/v1/completions", json={"prompt": "x", "stream": True})
    assert slow.headers["X-Stand-In"] == "A"
    for _ in range(3):  # A still has one outstanding: B takes every new one
        async with http.post(server.url + "/v1/completions", json={"prompt": "x"}) as resp:
            assert (await resp.json())["served_by"] == "B"
    gate.set()
    await slow.read()
    slow.release()


async def test_unhealthy_backend_taken_out_and_put_back(standin, proxy, http) -> None:
    a = await standin("A")
    b = await standin("B")
    server = await proxy(decode=[a.url, b.url])
    state = server.app_state
    a.health_status = 503
    await wait_for(lambda: not state.decode.backends[0].healthy)
    for _ in range(3):
        async with http.post(server.url + "/v1/completions", json={"prompt": "x"}) as resp:
            assert (await resp.json())["served_by"] == "B"
    assert state.metrics.registry.get_sample_value(
        "disagg_proxy_backend_healthy", {"role": "decode", "url": a.url}) == 0
    a.health_status = 200
    await wait_for(lambda: state.decode.backends[0].healthy)
    served = set()
    for _ in range(2):
        async with http.post(server.url + "/v1/completions", json={"prompt": "x"}) as resp:
            served.add((await resp.json())["served_by"])
    assert served == {"A", "B"}


async def test_refused_connection_retries_next_backend(standin, proxy, http) -> None:
    a = await standin("A")
    b = await standin("B")
    server = await proxy(decode=[a.url, b.url])
    await a.stop()  # dies between probes; the proxy still thinks it is healthy
    for _ in range(2):
        async with http.post(server.url + "/v1/completions", json={"prompt": "x"}) as resp:
            assert resp.status == 200
            assert (await resp.json())["served_by"] == "B"
    assert not server.app_state.decode.backends[0].healthy


async def test_every_decode_down_is_503_with_retry_after(standin, proxy, http) -> None:
    d = await standin("D")
    server = await proxy(decode=[d.url])
    await d.stop()  # dies between probes: the refused connection takes it out at once
    async with http.post(server.url + "/v1/completions", json={"prompt": "x"}) as resp:
        assert resp.status == 503
        assert resp.headers["Retry-After"] == "2"
        assert "no healthy decode instance" in (await resp.json())["error"]["message"]
    async with http.get(server.url + "/health") as resp:
        assert resp.status == 503 and resp.headers["Retry-After"] == "2"


async def test_a_backend_back_in_service_is_announced_to_measurement_owners(standin, proxy, http) -> None:
    a = await standin("A")
    server = await proxy(decode=[a.url])
    pool = server.app_state.decode
    returned: list[str] = []
    pool.on_return(lambda backend: returned.append(backend.url))
    a.health_status = 503
    await wait_for(lambda: not pool.backends[0].healthy)
    assert returned == []  # taken out: nothing to forget yet
    a.health_status = 200
    await wait_for(lambda: pool.backends[0].healthy)
    assert returned == [a.url] and pool.backends[0].returns == 1
    assert server.app_state.metrics.registry.get_sample_value(
        "disagg_proxy_backend_returns_total", {"role": "decode", "url": a.url}) == 1


async def test_a_busy_backend_survives_one_timed_out_probe_but_not_two(standin, http) -> None:
    """A one-core engine busy prefilling may miss one probe's deadline: it is taken out at the
    second timeout in a row, and an answer in between forgives the first."""
    a = await standin("A")
    metrics = ProxyMetrics()
    p = BackendPool("prefill", [a.url], metrics)
    [b] = p.backends
    prober = HealthProber([p], http, interval=60.0, timeout=DEADLINE)
    await prober.probe(p, b)
    assert b.healthy
    a.health_delay = LATE
    with p.lease(b):
        await prober.probe(p, b)
        assert b.healthy and b.strikes == 1           # strike one: still in service
        a.health_delay = 0.0
        await prober.probe(p, b)
        assert b.healthy and b.strikes == 0           # an answer forgives it
        a.health_delay = LATE
        await prober.probe(p, b)
        await prober.probe(p, b)
        assert not b.healthy and "TimeoutError" in (b.last_error or "")   # two in a row: out
    a.health_delay = 0.0
    await prober.probe(p, b)
    assert b.healthy and b.strikes == 0


async def test_an_idle_backend_also_survives_one_timed_out_probe_but_not_two(standin, http) -> None:
    """Idle engines get the same two strikes: one late probe of every engine at once must not
    take the whole role out of service (requests would get 503 while every engine works)."""
    engines = [await standin(name) for name in ("A", "B")]
    p = BackendPool("decode", [e.url for e in engines], ProxyMetrics())
    prober = HealthProber([p], http, interval=60.0, timeout=DEADLINE)
    await prober.probe_all()
    assert len(p.healthy()) == 2
    for engine in engines:
        engine.health_delay = LATE
    await prober.probe_all()                           # every probe late once, nothing in flight
    assert [(b.healthy, b.strikes, b.outstanding) for b in p.backends] == [(True, 1, 0), (True, 1, 0)]
    assert p.pick() is not None                        # still served
    await prober.probe_all()                           # the second in a row: out
    assert [b.healthy for b in p.backends] == [False, False] and p.pick() is None
    assert all("TimeoutError" in (b.last_error or "") for b in p.backends)


async def test_a_refused_connection_takes_a_backend_out_at_the_first_probe(standin, http) -> None:
    a = await standin("A")
    p = BackendPool("decode", [a.url], ProxyMetrics())
    [b] = p.backends
    prober = HealthProber([p], http, interval=60.0, timeout=DEADLINE)
    await prober.probe(p, b)
    assert b.healthy
    await a.stop()                                     # nothing listens: certain, no second chance
    await prober.probe(p, b)
    assert not b.healthy and b.strikes == 0 and "ClientConnectorError" in (b.last_error or "")


async def test_one_late_probe_of_the_only_decode_does_not_turn_requests_into_503(standin, proxy, http) -> None:
    """Through a running proxy (probes every 0.1 s): the only decode engine misses one probe's
    deadline while idle; requests sent meanwhile are all served."""
    d = await standin("D")
    server = await proxy(decode=[d.url], timeouts=replace(FAST, health_timeout=DEADLINE))
    backend = server.app_state.decode.backends[0]
    await wait_for(lambda: backend.healthy)
    d.health_delay = LATE
    await wait_for(lambda: backend.strikes == 1, timeout=3 * DEADLINE)
    d.health_delay = 0.0                               # the next probe, waiting or not, answers
    statuses = []
    for _ in range(5):
        async with http.post(server.url + "/v1/completions", json={"prompt": "x"}) as resp:
            statuses.append(resp.status)
    await wait_for(lambda: backend.strikes == 0)
    assert statuses == [200] * 5
    assert backend.healthy and backend.returns == 0    # never taken out
    assert server.app_state.metrics.registry.get_sample_value(
        "disagg_proxy_backend_healthy", {"role": "decode", "url": d.url}) == 1


async def test_a_busy_backend_with_an_error_status_goes_at_once(standin, http) -> None:
    a = await standin("A")
    p = BackendPool("prefill", [a.url], ProxyMetrics())
    [b] = p.backends
    prober = HealthProber([p], http, interval=60.0, timeout=DEADLINE)
    await prober.probe(p, b)
    a.health_status = 503
    with p.lease(b):
        await prober.probe(p, b)
    assert not b.healthy and b.last_error == "GET /health answered 503"


async def test_the_prober_reads_an_engines_kv_cache_size_each_time_it_comes_into_service(standin, http) -> None:
    """The routing prices the wait for room in an engine's KV cache: the prober reads its size from
    ``vllm:cache_config_info`` as the engine comes into service, and again when it comes back (a
    new process may have another), not at every probe."""
    a, b = await standin("A"), await standin("B")
    a.kv_blocks = 384                          # b declares none
    metrics = ProxyMetrics()
    p = BackendPool("decode", [a.url, b.url], metrics)
    prober = HealthProber([p], http, interval=60.0, timeout=DEADLINE)
    await prober.probe_all()
    ba, bb = p.backends
    assert (ba.kv_capacity_tokens, bb.kv_capacity_tokens) == (384 * 16, None)
    gauge = "disagg_proxy_backend_kv_capacity_tokens"
    assert metrics.registry.get_sample_value(gauge, {"role": "decode", "url": a.url}) == 384 * 16
    assert metrics.registry.get_sample_value(gauge, {"role": "decode", "url": b.url}) == 0
    a.kv_blocks = 20
    await prober.probe(p, ba)                  # still in service: not read again
    assert ba.kv_capacity_tokens == 384 * 16
    p.mark_down(ba, "restarted")
    await prober.probe(p, ba)
    assert ba.healthy and ba.kv_capacity_tokens == 20 * 16


def test_kv_capacity_comes_only_from_a_well_formed_declaration() -> None:
    info = 'vllm:cache_config_info{{block_size="{}",engine="0",num_gpu_blocks="{}"}} 1.0\n'
    assert kv_capacity_tokens("# TYPE vllm:cache_config_info gauge\n" + info.format(128, 48)) == 6144.0
    assert kv_capacity_tokens(info.format(128, "None")) is None          # before the engine sized it
    assert kv_capacity_tokens(info.format(128, 0)) is None
    assert kv_capacity_tokens(info.format("-16", 48)) is None
    assert kv_capacity_tokens("vllm:num_requests_running 0.0\n") is None
    assert kv_capacity_tokens("<html>not metrics {{{") is None
