"""The workload plan (disagg.workload_plan): per class TTFT/TPOT and goodput of colocated, replicas,
split and auto from a rate and a class mix, and the recommendation. No engines: measured rates are
stored in a temporary run directory."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from disagg.bench.slo import parse_slo
from disagg.bench.workload import parse_classes
from disagg.engines.vllm import served_model_name
from disagg.errors import PlanError
from disagg.kvmath import BUILTIN_MODELS
from disagg.measurements import store_decode, store_prefill
from disagg.planning import LinkEstimate, PrefillEstimate
from disagg.proxy.backends import BackendPool
from disagg.proxy.metrics import ProxyMetrics
from disagg.routecost import DecodeLine, Option
from disagg.topology import Topology, parse_topology
from disagg.workload_plan import (
    AUTO,
    COLOCATED,
    REPLICAS,
    SPLIT,
    EngineLoad,
    EngineModel,
    Layout,
    Mix,
    Wait,
    batch_join,
    evaluate,
    fixed_routes,
    kv_room_waits,
    least_outstanding_picks,
    least_outstanding_shares,
    mg1_wait,
    others_at_most,
    plan_workload,
    predict,
    receipt_factor,
    saturation_rate,
    whole_offered_chance,
)

LLAMA = BUILTIN_MODELS["llama-3.1-8b"]


def engine(name: str = "both[0]", host: str = "h", rate: float = 10_000.0, weights: float = 1e9,
           bw: float = 1e11, kv: float | None = None) -> EngineModel:
    return EngineModel(name, host, PrefillEstimate("test", estimated=False, arch=LLAMA, tokens_per_s=rate),
                       DecodeLine.from_memory_rate(weights, bw, "test"), kv, "test")


def mix(n: int = 1000, out: int = 100, kv_per_token: float = 1e5, share: float = 1.0, name: str = "c") -> Mix:
    return Mix(name, n, out, share, (n + out) * kv_per_token, (n + out / 2) * kv_per_token, n * kv_per_token,
               n * kv_per_token)


def test_mg1_wait_is_pollaczek_khinchine_and_unbounded_at_saturation() -> None:
    # 1 req/s of 0.5 s each (deterministic): rho 0.5, mean wait 1 x 0.25 / (2 x 0.5) = 0.25 s
    w = mg1_wait(1.0, 0.5, 0.25)
    assert (w.p, w.mean_s) == (0.5, pytest.approx(0.25))
    # P(wait > t) = rho exp(-t rho / mean): the median wait is 0 at rho 0.5
    assert w.exceeds(0.0) == 0.5 and w.exceeds(0.25) == pytest.approx(0.5 * math.exp(-0.5))
    assert mg1_wait(2.0, 1.0, 0.5) == Wait(1.0, math.inf)
    assert mg1_wait(0.0, 0.0, 0.0).exceeds(0.0) == 0.0


def test_rate_to_utilisation_to_ttft_on_one_engine() -> None:
    """One engine prefilling 1,000 tokens in 0.1 s: at 6 req/s rho is 0.6, the mean wait
    6 x 0.01 / (2 x 0.4) = 75 ms, and the median TTFT 0.1 s + (mean / rho) ln(2 rho). (The
    requests ask for no output, so no decode batch is there for a prefill to join.)"""
    e, m = engine(), mix(out=0)
    out = evaluate([m], 6.0, {"c": [(1.0, fixed_routes(Layout(COLOCATED, "x", both=(e,)), [m])["c"][0][1])]})
    load = out.loads["both[0]"]
    assert load.prefill_share == pytest.approx(0.6)
    assert load.wait.mean_s == pytest.approx(0.075)
    p = predict(Layout(COLOCATED, "x", both=(e,)), [m], 6.0, None)
    median_wait = 0.075 / 0.6 * math.log(1.2)
    assert p.classes[0].ttft_p50_s == pytest.approx(0.1 + median_wait, rel=1e-6)
    # below rho 0.5 half the requests do not wait: the median TTFT is the prefill alone
    assert predict(Layout(COLOCATED, "x", both=(e,)), [m], 4.0, None).classes[0].ttft_p50_s == pytest.approx(0.1)


def test_tpot_follows_the_prefill_share_and_the_decode_reads() -> None:
    """TPOT = (idle step + its own KV read) / (1 - prefill share - decode tokens/s x KV read per
    request per step)."""
    e, m = engine(), mix()
    p = predict(Layout(COLOCATED, "x", both=(e,)), [m], 4.0, None)
    idle = 1e9 / 1e11                                   # 10 ms: the weights read
    per_request = (1000 + 50) * 1e5 / 1e11              # 1.05 ms: one request's mean KV read
    expect = (idle + per_request) / (1 - 0.4 - 4.0 * 100 * per_request)
    assert p.classes[0].tpot_p50_s == pytest.approx(expect)
    assert p.loads[0].running == pytest.approx(400 * expect)      # Little's law


def test_saturation_gives_goodput_zero_and_the_rate_it_saturates_at() -> None:
    e, m = engine(bw=1e15), mix(out=1)           # decode all but free: prefill saturates at 10 req/s
    lay = Layout(COLOCATED, "x", both=(e,))
    sat = saturation_rate(lay, [m])
    assert sat == pytest.approx(10.0, rel=2e-3)
    p = predict(lay, [m], 12.0, parse_slo("ttft=5s"))
    assert p.goodput_rps == 0.0 and p.classes[0].ttft_p50_s is None
    assert "prefills take 120% of its time" in p.saturated[0]
    assert predict(lay, [m], 5.0, None).goodput_rps == 5.0


def test_kv_capacity_binds_the_requests_at_once() -> None:
    # one conversation 110 MB; 500 MB holds 4 of them: beyond that the configuration saturates
    e = engine(kv=500e6)
    m = mix()
    p = predict(Layout(COLOCATED, "x", both=(e,)), [m], 2.0, None)
    load = p.loads[0]
    assert load.kv_max_requests == 4
    needed = load.running * 110e6 + 2.0 * 0.1 * 100e6           # decoding + prefilling
    assert load.kv_needed_bytes == pytest.approx(needed)
    sat = saturation_rate(Layout(COLOCATED, "x", both=(e,)), [m])
    assert sat is not None and sat < 5
    over = predict(Layout(COLOCATED, "x", both=(e,)), [m], sat * 1.05, None)
    assert any("KV binds" in why for why in over.saturated)


def test_slo_share_counts_ttft_and_tpot() -> None:
    e, m = engine(), mix(out=10)
    lay = Layout(COLOCATED, "x", both=(e,))
    p = predict(lay, [m], 6.0, parse_slo("ttft=200ms"))
    # P(TTFT <= 0.2 s) = 1 - rho exp(-(0.2 - 0.1 - join) rho / mean wait), join 0 while the engine is
    # not decoding and join_s while it is (batch_join)
    load = p.loads[0]
    assert 0 < load.decoding_p < 1 and load.join_s > 0
    meets = sum(chance * (1 - 0.6 * math.exp(-(0.1 - join) * 0.6 / 0.075))
                for chance, join in ((1 - load.decoding_p, 0.0), (load.decoding_p, load.join_s)))
    assert p.classes[0].meets == pytest.approx(meets)
    assert p.goodput_rps == pytest.approx(6.0 * p.classes[0].meets)
    strict = predict(lay, [m], 6.0, parse_slo("ttft=10s,tpot=1ms"))     # TPOT above 1 ms: no request meets it
    assert strict.classes[0].meets == 0.0 and strict.goodput_rps == 0.0


# --- from topologies -------------------------------------------------------------------

ALIKE = """\
model: meta-llama/Llama-3.1-8B-Instruct
connector: nixl
link: {{type: ethernet, rate: {rate}}}
hosts:
  a: {{address: 10.0.0.1, device: cuda, gpu: h100}}
  b: {{address: 10.0.0.2, device: cuda, gpu: h100}}
roles:
  prefill: [{{host: a, port: 8100}}]
  decode: [{{host: b, port: 8200}}]
"""


def test_identical_hosts_over_a_slow_link_get_replicas() -> None:
    topo = parse_topology(ALIKE.format(rate="1gbit"), "alike.yaml")
    wp = plan_workload(topo, parse_classes("short=512:128@0.7,long=2048:256@0.3"), 4.0,
                       parse_slo("ttft=1s,tpot=50ms"), use_probe=False)
    by = {c.layout.label: c for c in wp.configs}
    assert set(by) == {"colocated on a", "colocated on b", "replicas (a, b)", "split a -> b", "auto a -> b",
                       "split b -> a", "auto b -> a"}
    assert wp.recommendation.config.layout.kind == REPLICAS
    assert "Recommendation: replicas" in wp.recommendation.text
    # 4 req/s of 0.3 x 256 MiB over 1 Gb/s (0.94 usable): the static split's link is saturated
    assert any("the link" in why for why in by["split a -> b"].saturated)
    replicas = by["replicas (a, b)"]
    assert replicas.goodput_rps == pytest.approx(4.0, rel=0.02)
    assert replicas.saturates_at_rps is not None and replicas.saturates_at_rps > by["colocated on a"].saturates_at_rps
    assert wp.recommendation.prefill_warning is None       # alike hosts: neither prefills slower


HOUSE = """\
model: {path: "disagg:tiny-kvheavy", max_model_len: 4096}
connector: socket
hosts:
  gamer: {address: 127.0.0.1, emulate: {prefill_rate: 20000, kv_memory: 96MiB}}
  workstation: {address: 127.0.0.1, emulate: {prefill_rate: 1000, kv_memory: 4GiB}}
roles:
  prefill: [{host: gamer, port: 8100, kv_port: 5601, cpus: [0]}]
  decode: [{host: workstation, port: 8200, kv_port: 5602, cpus: [1]}]
"""


def house(tmp_path: Path, text: str = HOUSE, rates: dict[str, float] | None = None) -> Topology:
    topo = parse_topology(text, str(tmp_path / "house.yaml"), run_dir=str(tmp_path / "run"))
    for host, rate in (rates or {}).items():
        store_prefill(topo.run_dir, served_model_name(topo), host, rate, "test bench", dtype=topo.model.dtype)
    return topo


def test_an_emulated_host_without_a_measurement_is_not_planned_from_its_stated_rate(tmp_path: Path) -> None:
    topo = house(tmp_path, rates={"workstation": 1000.0})
    with pytest.raises(PlanError) as info:
        plan_workload(topo, parse_classes("long=2048:32"), 1.0)
    text = str(info.value)
    assert "hosts.gamer is emulated" in text and "never uses the stated rate" in text
    assert "`disagg up" in text and "`disagg bench compare" in text and "--prefill-host gamer" in text
    assert "`disagg bench prefill" in text


def test_measured_decode_steps_and_rates_of_each_engine_kind_are_the_plan_s(tmp_path: Path) -> None:
    """Colocated and replica configurations run engines without a KV connector, splits the
    topology's (socket here): each gets the prefill rate and decode step measured on its kind of
    engine (the emulated house's gamer prefilled at 2,862 tokens/s colocated and 1,246 as a NIXL
    prefill engine on one core). A request's TPOT is the measured step with its own KV and the
    others' (Little's law), stretched by the prefills."""
    topo = house(tmp_path)
    model, run = served_model_name(topo), topo.run_dir
    for host, plain, with_socket in (("gamer", 2862.0, 1246.0), ("workstation", 299.0, 284.0)):
        store_prefill(run, model, host, plain, "colocated probe", connector="none")
        store_prefill(run, model, host, with_socket, "split probe", connector="socket")
    store_decode(run, model, "gamer", 0.0045, 1e-10, "colocated decode probe", connector="none",
                 measured_at="2026-12-05T10:00:00+00:00")
    store_decode(run, model, "workstation", 0.005, 2e-10, "split decode probe", connector="socket",
                 measured_at="2026-12-05T10:00:00+00:00")
    wp = plan_workload(topo, parse_classes("long=1024:32"), 0.1)
    by = {c.layout.label: c for c in wp.configs}
    gamer_split = next(e for e in wp.engines if e.host == "gamer")
    gamer_alone = next(e for e in wp.plain_engines if e.host == "gamer")
    assert (gamer_split.prefill.tokens_per_s, gamer_alone.prefill.tokens_per_s) == (1246.0, 2862.0)
    assert (gamer_split.connector, gamer_alone.connector) == ("socket", "none")
    # below rho 0.5 the median waits nothing: TTFT p50 is the prefill on the colocated kind of engine
    assert by["colocated on gamer"].classes[0].ttft_p50_s == pytest.approx(1024 / 2862, rel=1e-6)
    # the measured step, with the request's own KV (1,024 + 16 tokens of 32 KiB) and the prefills' share
    share, tokens_per_s = 0.1 * 1024 / 2862, 0.1 * 32
    own = (1024 + 16) * 32 * 1024 * 1e-10
    assert by["colocated on gamer"].classes[0].tpot_p50_s == pytest.approx(
        (0.0045 + own) / (1 - share - tokens_per_s * own))
    assert gamer_alone.decode.measured and gamer_alone.decode.source.startswith("measured on gamer 2026-12-05")
    # no gamer step of the socket kind: the colocated one serves, labelled so
    assert gamer_split.decode.fixed_s == 0.0045 and "none stored for an engine with socket" in gamer_split.decode.source
    # the split decodes on the workstation's socket engine: its own step, no prefills there
    ws_split = next(e for e in wp.engines if e.host == "workstation")
    assert by["split gamer -> workstation"].classes[0].tpot_p50_s == pytest.approx(
        (0.005 + 2 * own) / (1 - tokens_per_s * 2 * own))
    assert ws_split.decode.source.startswith("measured on workstation") and "none stored" not in ws_split.decode.source
    js = wp.to_json()
    assert js["plain_engines"][0]["decode_measured"] is True and js["engines"][0]["connector"] == "socket"


def test_each_class_decodes_with_its_own_kv() -> None:
    """Two classes on one engine: each step reads every running request's KV, so a class's TPOT is
    the engine's mean TPOT moved by how far its own KV is from the mean, per byte."""
    e = engine(weights=1e9, bw=1e11)
    short, long_ = mix(100, 10, share=0.5, name="short"), mix(1000, 10, share=0.5, name="long")
    p = predict(Layout(COLOCATED, "x", both=(e,)), [short, long_], 1.0, None)
    load = p.loads[0]
    stretch = 1 / (1 - load.prefill_share)
    gap = (long_.kv_mean_bytes - short.kv_mean_bytes) / 1e11 * stretch
    assert p.classes[1].tpot_p50_s - p.classes[0].tpot_p50_s == pytest.approx(gap)
    mean = (short.kv_mean_bytes + long_.kv_mean_bytes) / 2
    assert p.classes[0].tpot_p50_s == pytest.approx(load.tpot_s + (short.kv_mean_bytes - mean) / 1e11 * stretch)


def test_a_fast_prefill_host_whose_kv_binds_prefills_for_the_memory_rich_host(tmp_path: Path) -> None:
    """The gamer prefills 20 x faster but holds one 2,080-token conversation at once (96 MiB): alone
    its KV binds; the workstation alone cannot prefill 1 req/s of 2,048 tokens (2 s each); a split
    puts each phase where it fits."""
    topo = house(tmp_path, rates={"gamer": 20_000.0, "workstation": 1000.0})
    wp = plan_workload(topo, parse_classes("long=2048:32"), 1.0, parse_slo("ttft=2s,tpot=200ms"))
    by = {c.layout.label: c for c in wp.configs}
    assert any("KV binds" in why for why in by["colocated on gamer"].saturated)
    assert any("prefills take 205% of its time" in why for why in by["colocated on workstation"].saturated)
    assert not by["split gamer -> workstation"].saturated
    assert by["split gamer -> workstation"].goodput_rps == pytest.approx(1.0, rel=0.02)
    rec = wp.recommendation
    assert rec.config.layout.kind in (SPLIT, AUTO) and rec.prefill_hosts == ("gamer",)
    assert rec.decode_hosts == ("workstation",) and rec.config.layout.ratio == "1:1"
    assert "gamer prefills, workstation decodes (P:D 1:1)" in rec.text
    # the emulated KV capacity is the plan's, per engine
    gamer = next(e for e in wp.engines if e.host == "gamer")
    assert gamer.kv_capacity_bytes == 96 * 2**20 and "emulated" in gamer.kv_source
    assert any("KV binds: prefill[0] on gamer: at most 1 requests" in line for line in wp.kv_binds)


def test_the_topology_s_slower_prefill_host_is_named(tmp_path: Path) -> None:
    text = HOUSE.replace("prefill: [{host: gamer", "prefill: [{host: TMP").replace(
        "decode: [{host: workstation", "decode: [{host: gamer").replace("TMP", "workstation")
    topo = house(tmp_path, text, rates={"gamer": 20_000.0, "workstation": 1000.0})
    wp = plan_workload(topo, parse_classes("long=2048:32"), 1.0, parse_slo("ttft=2s,tpot=200ms"))
    rec = wp.recommendation
    assert rec.prefill_warning is not None
    assert "The topology has workstation prefilling, the slower host at prefill" in rec.prefill_warning
    assert "workstation 1,000 against gamer 20,000 tokens/s" in rec.prefill_warning
    assert rec.prefill_hosts == ("gamer",)       # the better split prefills on the gamer all the same
    labels = [c.layout.label for c in wp.configs]
    assert labels.index("split workstation -> gamer") < labels.index("split gamer -> workstation")


def test_auto_routes_each_class_by_the_router_s_costs(tmp_path: Path) -> None:
    """Short prompts are never split (a handoff costs more than their prefill anywhere), long ones
    never prefilled by the workstation (2 s each); either may go whole to the gamer while the
    workstation's decodes run slower than the gamer's (the proxy's decode_load rule)."""
    topo = house(tmp_path, rates={"gamer": 20_000.0, "workstation": 1000.0})
    wp = plan_workload(topo, parse_classes("short=16:32@0.5,long=2048:32@0.5"), 0.5)
    auto = next(c for c in wp.configs if c.layout.label == "auto gamer -> workstation")
    short, long = auto.classes
    assert str(Option.SPLIT) not in short.routes
    assert short.routes[str(Option.LOCAL)] + short.routes.get(str(Option.WHOLE), 0.0) == pytest.approx(1.0)
    assert str(Option.LOCAL) not in long.routes
    assert long.routes[str(Option.SPLIT)] + long.routes.get(str(Option.WHOLE), 0.0) == pytest.approx(1.0)
    assert long.routes[str(Option.SPLIT)] > 0.5
    assert long.ttft_p50_s is not None and long.ttft_p50_s < 1.0 < 2048 / 1000


def test_a_class_beyond_max_model_len_is_refused(tmp_path: Path) -> None:
    topo = house(tmp_path, rates={"gamer": 20_000.0, "workstation": 1000.0})
    with pytest.raises(PlanError, match="longer than the topology's max_model_len"):
        plan_workload(topo, parse_classes("huge=4000:200"), 1.0)


def test_the_json_carries_every_configuration_per_class(tmp_path: Path) -> None:
    topo = house(tmp_path, rates={"gamer": 20_000.0, "workstation": 1000.0})
    data = plan_workload(topo, parse_classes("short=16:32@0.5,long=2048:32@0.5"), 0.5,
                         parse_slo("ttft=2s,tpot=200ms")).to_json()
    assert data["workload"]["rate_rps"] == 0.5
    assert [c["name"] for c in data["workload"]["classes"]] == ["short", "long"]
    assert data["slo"] == {"ttft": 2.0, "tpot": 0.2}
    kinds = [c["kind"] for c in data["configurations"]]
    assert kinds.count(COLOCATED) == 2 and kinds.count(REPLICAS) == 1
    assert kinds.count(SPLIT) == 2 and kinds.count(AUTO) == 2
    for c in data["configurations"]:
        assert [k["class"] for k in c["classes"]] == ["short", "long"]
    assert data["recommendation"]["prefill_hosts"] == ["gamer"]


def test_least_outstanding_picks_the_engine_with_fewer_in_flight() -> None:
    """Each request to the engine with the fewest in flight, the first of the tied ones after the
    engine picked last, the counts Poisson: equal means, equal shares; against an engine with one
    in flight on average (busy p = 1 - exp(-1) of the time), an idle one gets 1 / (2 - p) of the
    requests: every tie after a pick of its own goes to the other engine (an even coin on the ties
    would give it 1 - exp(-1) / 2)."""
    assert least_outstanding_picks([0.7, 0.7]) == [pytest.approx(0.5), pytest.approx(0.5)]
    assert least_outstanding_picks([0.0, 1.0])[0] == pytest.approx(1 / (1 + math.exp(-1)))
    three = least_outstanding_picks([0.0, 0.0, 0.0])
    assert three == [pytest.approx(1 / 3)] * 3
    # the shares are a fixed point: an engine holding each request 3 s against one holding 1 s
    shares = least_outstanding_shares([lambda lam: 1.0, lambda lam: 3.0], 1.0)
    assert shares[0] > 0.5 and sum(shares) == pytest.approx(1.0)
    assert least_outstanding_picks([shares[0] * 1.0, shares[1] * 3.0])[0] == pytest.approx(shares[0], abs=1e-6)


@pytest.mark.parametrize("means", [[0.3, 1.2], [0.5, 0.5, 2.0], [0.2, 0.9, 1.5, 0.1]])
def test_least_outstanding_picks_are_the_proxy_pools_own(means: list[float]) -> None:
    """The model's shares are what the proxy's own pool (:meth:`BackendPool.pick`) gives when each
    arrival finds Poisson counts of those means in flight: 20,000 picks, seeded, within 0.015."""
    pool = BackendPool("decode", [f"http://h{i}:1" for i in range(len(means))], ProxyMetrics())
    for b in pool.backends:
        pool.mark_up(b)
    draws = 20_000
    counts, picked = np.random.default_rng(7).poisson(means, size=(draws, len(means))), [0] * len(means)
    for row in counts:
        for b, count in zip(pool.backends, row, strict=True):
            b.outstanding = int(count)
        chosen = pool.pick()
        assert chosen is not None
        picked[pool.backends.index(chosen)] += 1
    model = least_outstanding_picks(means)
    assert [c / draws for c in picked] == [pytest.approx(m, abs=0.015) for m in model]


def test_the_pool_gives_the_slow_engine_less_at_any_load_then_shares_by_capacity() -> None:
    """The proxy's pool sends each request to the engine with the fewest in flight, round-robin
    among ties: a slow replica holds its requests longer, so even at light load it gets less than
    half (a replica pool's TTFT p50 leans to the fast box), and less still as its queue grows."""
    fast, slow = engine("both[0]", "a", rate=10_000.0), engine("both[1]", "b", rate=1_000.0)
    m = mix(out=10)                                     # 0.1 s on a, 1 s on b (decode reads ~1e-4 s)
    lay = Layout(REPLICAS, "pool", both=(fast, slow))
    light = evaluate([m], 0.2, fixed_routes(lay, [m]))
    a, b = light.loads["both[0]"].prefill_rps, light.loads["both[1]"].prefill_rps
    assert a + b == pytest.approx(0.2) and 0.5 < a / 0.2 < 0.7
    # an equal 1.25 req/s would overload b (about 1 req/s): its queue keeps more in flight there,
    # so the pool sends it less, short of its capacity
    heavy = evaluate([m], 2.5, fixed_routes(lay, [m]))
    assert heavy.loads["both[1]"].prefill_share < 0.8 and not heavy.saturated
    assert heavy.loads["both[1]"].prefill_rps / 2.5 < b / 0.2


def test_a_new_request_joins_the_running_batch() -> None:
    """While an engine decodes, a new prefill waits out the step in progress and shares its own step
    with the batch's KV reads: with 1 request decoding on average (Poisson), the engine decodes with
    chance 1 - exp(-1), then 1 / (1 - exp(-1)) requests on average; join = fixed / 2 + 1.5 x that x
    KV x per byte. Idle: nothing added."""
    line = DecodeLine(0.01, 1e-11, "test")
    p = 1 - math.exp(-1)
    got = batch_join(line, 1.0, 1e8)
    assert got["decoding_p"] == pytest.approx(p)
    assert got["join_s"] == pytest.approx(0.005 + 1.5 * (1 / p) * 1e8 * 1e-11)
    assert batch_join(line, 0.0, 1e8) == {"decoding_p": 0.0, "join_s": 0.0}
    # an engine busy decoding (running >> 1) at a light prefill load (rho 0.1 < 0.5): the median
    # TTFT is the prefill and the join, no queue wait
    e, m = engine(), mix(out=100)
    pred = predict(Layout(COLOCATED, "x", both=(e,)), [m], 1.0, None)
    load = pred.loads[0]
    assert load.running > 1 and load.decoding_p > 0.5
    assert load.join_s == pytest.approx(batch_join(e.decode, load.running, load.mean_kv_bytes)["join_s"])
    assert pred.classes[0].ttft_p50_s == pytest.approx(0.1 + load.join_s, rel=1e-6)


def test_a_prompt_waits_for_room_in_a_full_kv_cache() -> None:
    """vLLM schedules a prompt once its KV fits beside the running requests': with a Poisson count of
    mean 1 decoding, each holding 6 units of a 10-unit room, a 5-unit prompt waits when one or more
    run (1 - e^-1), a 3-unit one when two or more do (1 - 2/e); until the first running one ends,
    its remaining decode uniform over its 8 s: 8 / (1 + 1) s with one running on average."""
    waits = kv_room_waits(10.0, [(1.0, 6.0, 8.0)], {"big": 5.0, "small": 3.0, "none": 0.0})
    assert waits["big"].p == pytest.approx(1 - math.exp(-1))
    assert waits["big"].mean_s == pytest.approx((1 - math.exp(-1)) * 4.0)
    assert waits["small"].p == pytest.approx(1 - 2 * math.exp(-1))
    assert waits["none"].p == pytest.approx(1 - 2 * math.exp(-1))         # 2 or more: 12 > 10
    assert kv_room_waits(10.0, [], {"big": 5.0})["big"] == Wait(0.0, 0.0)
    # many requests at once: the normal approximation of the held sum (mean 40, sd sqrt(20 x 4)),
    # the first of 20 to end after 1 / 21 of a decode
    many = kv_room_waits(40.0, [(20.0, 2.0, 1.0)], {"x": 0.0})["x"]
    assert many.p == pytest.approx(0.5) and many.mean_s == pytest.approx(0.5 / 21)


def test_a_prompt_waiting_for_room_holds_the_engine_s_queue() -> None:
    """A prompt that waits for room holds the prompts behind it (first come, first served): the same
    engine with a KV cache that fills has a longer prefill queue, and each class's TTFT carries its
    own wait for room besides."""
    m = mix(out=100)
    lay_free = Layout(COLOCATED, "x", both=(engine(),))
    lay_full = Layout(COLOCATED, "x", both=(engine(kv=400e6),))         # 3 conversations of 110 MB
    free = evaluate([m], 3.0, fixed_routes(lay_free, [m]))
    full = evaluate([m], 3.0, fixed_routes(lay_full, [m]))
    load = full.loads["both[0]"]
    assert 0 < load.kv_wait("c").p < 1
    assert load.queue_share > load.prefill_share
    assert load.wait.mean_s > free.loads["both[0]"].wait.mean_s
    assert all(b.wait.p >= load.kv_wait("c").p for b in full.branches["c"])
    assert not free.loads["both[0]"].kv_waits or free.loads["both[0]"].kv_wait("c") == Wait(0.0, 0.0)


def test_a_request_s_tpot_spreads_with_the_requests_beside_it() -> None:
    """A request's TPOT is its steps' mean: the others overlapping its decode are a Poisson count of
    mean 2 x running, each beside it for a uniform share of it, so the share meeting a TPOT limit
    at the mean TPOT is about a half, not all or nothing."""
    assert others_at_most(1.0, 0.0) == pytest.approx(math.exp(-2))          # nobody overlaps it
    assert others_at_most(1.0, 50.0) == pytest.approx(1.0)
    assert others_at_most(0.0, 0.0) == 1.0 and others_at_most(1.0, -0.1) == 0.0
    # k overlapping (Poisson, mean 2) are beside it for at most half its decode in all with the
    # Irwin-Hall chance 0.5^k / k!
    half = sum(math.exp(-2) * 2**k / math.factorial(k) * 0.5**k / math.factorial(k) for k in range(30))
    assert others_at_most(1.0, 0.5) == pytest.approx(half)
    e, m = engine(), mix(out=100)
    lay = Layout(COLOCATED, "x", both=(e,))
    mean = predict(lay, [m], 1.0, None)
    tpot, load = mean.classes[0].tpot_p50_s, mean.loads[0]
    assert tpot is not None and load.running > 1
    at_mean = predict(lay, [m], 1.0, parse_slo(f"tpot={tpot * 1000}ms")).classes[0].meets
    assert at_mean == pytest.approx(others_at_most(load.running, load.running))
    assert 0.4 < at_mean < 0.6


def test_a_prefill_time_measured_at_two_lengths_grows_as_measured() -> None:
    """A measured rate probed at 2,048 and 256 tokens: the time is a x n + b x n^2 through both
    (attention's square part on a real engine; linear on an emulated one, which holds each step
    for tokens / rate)."""
    from disagg.measurements import PrefillMeasurement, fit_prefill_time

    real = PrefillMeasurement("m", "h", 1787.0, "", "", points=((2048.0, 1.146), (256.0, 0.083)))
    shape = real.fit()
    assert shape is not None and shape[1] > 0
    est = PrefillEstimate("x", estimated=False, arch=LLAMA, tokens_per_s=1787.0, shape=shape)
    assert est.seconds(2048) == pytest.approx(1.146) and est.seconds(256) == pytest.approx(0.083)
    assert est.rate(2048) == pytest.approx(2048 / 1.146)
    # an emulated host, linear: no square part
    a, b = fit_prefill_time([(2048.0, 2048 / 300), (256.0, 256 / 300)])
    assert (a, b) == (pytest.approx(1 / 300), pytest.approx(0.0, abs=1e-15))
    # a time growing slower than linearly is taken as linear through the points
    a, b = fit_prefill_time([(2048.0, 1.0), (256.0, 0.5)])
    assert b == 0.0 and a == pytest.approx((2048 * 1.0 + 256 * 0.5) / (2048**2 + 256**2))
    with pytest.raises(ValueError, match="two prompt lengths"):
        fit_prefill_time([(2048.0, 1.0)])
    assert PrefillMeasurement("m", "h", 1787.0, "", "").fit() is None


def test_a_handoff_into_a_decoding_cpu_engine_shares_its_cores() -> None:
    """A handed-over request on a decode engine that is decoding waits for its batch (the join) and
    half a step more (vLLM notices the load done at a step's end); on a one-core CPU engine the
    handoff also takes twice as long there (the receipt gets half the core); idle, the handoff's
    own time. The factor follows the pinned cores: (n + 1) / n."""
    assert receipt_factor("cpu", 1) == 2.0
    assert receipt_factor("cpu", 4) == 1.25
    assert receipt_factor("cuda", 1) == 1.0
    assert receipt_factor("cpu", 0) == 1.0          # unpinned: not known, not priced
    link = LinkEstimate(usable_bps=8e9, rtt_s=0.0, label="test", measured=True, measured_fixed_s=0.01)
    m = mix(n=1000, out=100)
    hand = link.added_s(m.wire_bytes, 0.1, None)
    assert hand > 0.1

    loads = []

    def branches(factor: float) -> list[tuple[float, float]]:
        p = engine("prefill[0]", "p", rate=10_000.0)
        d = replace(engine("decode[0]", "d", rate=1_000.0), busy_receipt_factor=factor)
        layout = Layout(SPLIT, "split p -> d", prefill=(p,), decode=(d,), link=link)
        out = evaluate([m], 1.0, fixed_routes(layout, [m]))
        loads.append(out.loads["decode[0]"])
        assert out.loads["decode[0]"].decoding_p > 0.5
        return sorted((b.share, b.base_s) for b in out.branches["c"])

    gpu, cpu = branches(1.0), branches(2.0)
    d_load = loads[0]
    want = sorted([(1 - d_load.decoding_p, 0.1 + hand),
                   (d_load.decoding_p, 0.1 + hand + d_load.join_s + d_load.tpot_s / 2)])
    assert [x for b in gpu for x in b] == pytest.approx([x for b in want for x in b])
    # the idle branch: the same; the decoding branch: the handoff once more on the one-core engine
    idle = [b for b in gpu if b[1] == pytest.approx(0.1 + hand)]
    assert idle and idle == [b for b in cpu if b[1] == pytest.approx(0.1 + hand)]
    busy_gpu = [b for b in gpu if b not in idle]
    busy_cpu = [b for b in cpu if b not in idle]
    assert [s for s, _ in busy_gpu] == pytest.approx([s for s, _ in busy_cpu])
    assert [t - g for (_, t), (_, g) in zip(busy_cpu, busy_gpu, strict=True)] == pytest.approx([hand])


def test_a_pinned_one_core_cpu_decode_engine_gets_the_receipt_factor(tmp_path: Path) -> None:
    """plan builds each engine's receipt factor from its host's device and pinned cores: the house's
    one-core CPU engines 2; the same engines on GPU hosts 1."""
    topo = house(tmp_path, rates={"gamer": 20_000.0, "workstation": 1000.0})
    wp = plan_workload(topo, parse_classes("long=2048:32"), 1.0, None)
    assert {e.host: e.busy_receipt_factor for e in wp.engines} == {"gamer": 2.0, "workstation": 2.0}
    topo = parse_topology(ALIKE.format(rate="10gbit"), "alike.yaml")
    wp = plan_workload(topo, parse_classes("long=2048:32"), 1.0, None, use_probe=False)
    assert {e.busy_receipt_factor for e in wp.engines} == {1.0}


def _load(name: str, running: float, added_s: float) -> EngineLoad:
    return EngineLoad(engine=name, host="h", prefill_rps=0.0, prefill_share=0.0, wait=Wait(0.0, 0.0), decode_tps=0.0,
                      tpot_s=0.01, running=running, kv_needed_bytes=0.0, kv_capacity_bytes=None,
                      kv_max_requests=None, tpot_added_s=added_s)


def test_whole_is_offered_for_the_prompts_that_find_the_decode_engine_holding_more() -> None:
    """The router offers ``whole`` where one more decode on the decode engine would be slower than
    one more on the prefill engine, at the counts a prompt finds: alike engines holding Poisson
    counts of equal means offer it when the decode engine holds more, P(X > Y) = (1 - P(X = Y)) / 2;
    idle engines alike, never; a decode engine holding more on average, more often."""
    p, d = engine("prefill[0]", "p"), engine("decode[0]", "d")
    assert whole_offered_chance(p, None, d, None) == 0.0
    same = whole_offered_chance(p, _load("p", 1.0, 0.002), d, _load("d", 1.0, 0.002))
    tie = sum((math.exp(-1.0) / math.factorial(k)) ** 2 for k in range(40))
    assert same == pytest.approx((1 - tie) / 2)
    assert whole_offered_chance(p, _load("p", 0.2, 0.002), d, _load("d", 2.0, 0.002)) > 0.7
    assert whole_offered_chance(p, _load("p", 1.0, 0.002), d, _load("d", 1.0, 0.002), factor=100.0) == 0.0
