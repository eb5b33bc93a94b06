"""The verdict arithmetic behind `disagg plan`."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from disagg import topology
from disagg.errors import PlanError
from disagg.kvmath import BUILTIN_MODELS
from disagg.measurements import LinkMeasurement, store_link, store_prefill
from disagg.planning import (
    FP8_CPU_CONVERT_BYTES_PER_S,
    FP8_GPU_CONVERT_BYTES_PER_S,
    HANDOFF_ROUND_TRIPS,
    MARGINAL,
    NO_PAY,
    PAYS,
    PROXY_HOP_S,
    LinkEstimate,
    MemoryEstimate,
    PrefillEstimate,
    make_plan,
    plan_topology,
    route_seeds,
    verdict_for,
)
from disagg.routecost import exposed_transfer_s
from disagg.topology import load_topology, parse_topology
from disagg.units import fmt_rate


@pytest.fixture(autouse=True)
def _state_of_this_test_only(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The repo's topologies keep their state under the default run_dir (``.disagg`` in the
    working directory), where a developer's ``disagg bench`` and ``probe-link`` store what the
    plan reads: each test here reads a run_dir of its own, empty as in a fresh clone."""
    monkeypatch.setattr(topology, "DEFAULT_RUN_DIR", str(tmp_path / "default-run-dir"))

LLAMA = BUILTIN_MODELS["llama-3.1-8b"]
MIB = 1 << 20


def link(bps: float, rtt: float = 0.0) -> LinkEstimate:
    return LinkEstimate(bps, rtt, "test link", measured=False)


def prefill_rate(tokens_per_s: float) -> PrefillEstimate:
    return PrefillEstimate("test", estimated=False, arch=LLAMA, tokens_per_s=tokens_per_s)


@pytest.mark.parametrize(("handoff", "verdict"), [(0.1, PAYS), (1.0, PAYS), (1.5, MARGINAL), (2.0, MARGINAL),
                                                  (2.5, NO_PAY)])
def test_verdict_compares_the_split_with_the_decode_host_prefilling_itself(handoff: float, verdict: str) -> None:
    # P prefills in 1 s, D would take 2 s itself: the split answers at 1 s + handoff
    got, reason = verdict_for(handoff, 1.0, 100 * MIB, link(1e9), local_s=2.0)
    assert got == verdict
    assert "100 MiB" in reason


def test_a_split_slower_than_the_local_prefill_never_pays() -> None:
    # the user's case: the handoff is under half the prefill host's 4.04 s, but the decode host
    # prefills the prompt itself in 1.5 s; the split (4.04 + 1.88 s) answers far later
    got, reason = verdict_for(1.88, 4.04, 2 << 30, link(9.4e9), local_s=1.5)
    assert got == NO_PAY
    assert "longer than the 1.5 s the decode host takes to prefill it itself" in reason
    got, reason = verdict_for(1.0, 4.04, 2 << 30, link(9.4e9), local_s=1.5)
    assert got == MARGINAL and "later than the decode host prefilling it itself (1.5 s)" in reason


def test_no_pay_reason_names_the_rate_that_would_pay() -> None:
    # 100 MiB must move within the 3 s local prefill minus P's 1 s and the 1 ms fixed cost
    _, reason = verdict_for(3.5, 1.0, 100 * MIB, link(1e9), local_s=3.0)
    need = 100 * MIB * 8 / (3.0 - 1.0 - PROXY_HOP_S)
    assert f"the link would need {fmt_rate(need)} for the split to answer sooner" in reason


def test_handoff_is_fixed_cost_plus_bytes_over_rate() -> None:
    est = link(8e9, rtt=1e-3)
    assert est.handoff_s(1e9) == pytest.approx(HANDOFF_ROUND_TRIPS * 1e-3 + PROXY_HOP_S + 1.0)


def test_plan_rows_and_memory_fit() -> None:
    plan = make_plan(LLAMA, "bfloat16", link(2.35e9), prefill_rate(5000.0), MemoryEstimate(26e9, "26 GB"),
                     [256, 2048], 256)
    row = plan.classes[1]
    assert row.kv_bytes == 256 * MIB
    assert row.handoff_s == pytest.approx(PROXY_HOP_S + 256 * MIB * 8 / 2.35e9)
    assert row.prefill_s == pytest.approx(2048 / 5000.0)
    assert row.conversations == int(26e9 // ((2048 + 256) * 131072)) == 86
    assert row.verdict == NO_PAY


def test_pays_from_is_the_shortest_prompt_the_split_answers_sooner() -> None:
    # a fast P (8,000 tok/s), a slow D (1,000 tok/s), a fast link with a big fixed cost: short prompts stay
    est = link(100e9, rtt=0.05)
    plan = make_plan(LLAMA, "bfloat16", est, prefill_rate(8000.0), MemoryEstimate(None, "?"), [1, 4096], 0,
                     decode_prefill=prefill_rate(1000.0), max_prompt_tokens=16384)
    n = plan.pays_from_tokens
    assert n is not None and plan.pays_span == (n, 16384)
    assert n / 8000 + est.handoff_s(LLAMA.kv_bytes(n)) <= n / 1000
    assert (n - 1) / 8000 + est.handoff_s(LLAMA.kv_bytes(n - 1)) > (n - 1) / 1000
    assert plan.break_even_tokens is not None and plan.break_even_tokens < n
    assert [c.verdict for c in plan.classes] == [NO_PAY, PAYS]
    assert plan.idle_split_from_tokens == n
    assert plan.classes[0].conversations is None


def test_summary_and_routing_agree_with_the_rows() -> None:
    from disagg.planning import idle_routing_line, summary_line
    # alike rates, a slow link: no row pays, and neither summary nor routing says one does
    plan = make_plan(LLAMA, "bfloat16", link(9.4e9, rtt=1e-4), prefill_rate(5000.0), MemoryEstimate(None, "?"),
                     [16384], 0, decode_prefill=prefill_rate(11000.0), max_prompt_tokens=16384)
    assert plan.classes[0].verdict == NO_PAY and plan.pays_span is None
    assert "does not pay for any prompt up to 16,384" in summary_line(plan)
    assert "every prompt stays local" in (idle_routing_line(plan) or "")


def test_a_split_that_stops_paying_as_prompts_grow_is_a_span() -> None:
    # P is faster per token, but its estimate's attention grows faster than D's: the summary gives both
    # ends instead of claiming every longer prompt pays
    arch = BUILTIN_MODELS["llama-3.1-70b"]
    fast = PrefillEstimate("p", estimated=True, arch=arch, flops_per_s=400e12)
    slow = PrefillEstimate("d", estimated=False, arch=arch, tokens_per_s=1500.0)
    plan = make_plan(arch, "bfloat16", link(100e9), fast, MemoryEstimate(None, "?"), [256, 100_000], 0,
                     decode_prefill=slow, max_prompt_tokens=131072)
    assert plan.pays_span is not None
    lo, hi = plan.pays_span
    assert lo < 256 <= hi < 100_000
    assert plan.classes[0].verdict == PAYS and plan.classes[1].verdict != PAYS
    from disagg.planning import summary_line
    assert f"prompts of {lo:,} to {hi:,} tokens" in summary_line(plan)


def test_never_pays_within_the_context_limit() -> None:
    plan = make_plan(LLAMA, "bfloat16", link(1e6), prefill_rate(1e6), MemoryEstimate(None, "?"), [512], 0,
                     max_prompt_tokens=4096)
    assert plan.break_even_tokens is None and plan.pays_from_tokens is None
    assert plan.search_limit == 4096


def test_house_topology_over_2g5_does_not_pay_but_roce_does() -> None:
    """The gamer (RTX 4090) prefills for a DGX Spark: over 2.5 GbE moving 2,048 tokens' KV takes
    longer than the Spark prefilling them; over RoCE the split answers sooner."""
    topo = load_topology("topologies/house-2g5.yaml")
    plan = plan_topology(topo, [2048], 256, use_probe=False)
    row = plan.classes[0]
    assert plan.prefill.estimated and "ESTIMATE" in plan.prefill.label and "RTX 4090" in plan.prefill.label
    assert plan.link.usable_bps == 2.35e9 and not plan.link.measured
    assert row.verdict == NO_PAY
    assert row.conversations == 298       # kv_memory_gb: 90 on the workstation
    roce = plan_topology(topo, [8192], 256, link_class="roce-100g")
    assert roce.classes[0].verdict == PAYS


def test_sparks_decode_memory_is_estimated_from_the_gpu() -> None:
    plan = plan_topology(load_topology("topologies/two-sparks-cx7.yaml"), [2048], 0)
    expected = 128e9 * 0.85 - BUILTIN_MODELS["qwen3-8b"].params * 2
    assert plan.memory.kv_bytes == pytest.approx(expected)
    assert "ESTIMATE" in plan.memory.label


def _copy_house(tmp_path):
    dst = tmp_path / "house.yaml"
    shutil.copy("topologies/house-2g5.yaml", dst)
    return load_topology(dst, run_dir=str(tmp_path / "run"))


def test_measured_prefill_rate_replaces_the_estimate(tmp_path) -> None:
    topo = _copy_house(tmp_path)
    store_prefill(topo.run_dir, "meta-llama/Llama-3.1-8B-Instruct", "gamer", 10000.0, "test bench",
                  dtype="bfloat16")
    plan = plan_topology(topo, [4096], 0)
    assert not plan.prefill.estimated and "test bench" in plan.prefill.label
    assert plan.classes[0].prefill_s == pytest.approx(0.4096)
    # a rate measured with another dtype is no measurement of this topology's engines
    store_prefill(topo.run_dir, "meta-llama/Llama-3.1-8B-Instruct", "gamer", 10000.0, "test bench", dtype="float32")
    other = plan_topology(topo, [4096], 0).prefill
    assert other.estimated and "measured in float32; this topology runs bfloat16" in other.label


def test_measured_link_replaces_the_table_unless_it_is_for_other_hosts(tmp_path) -> None:
    topo = _copy_house(tmp_path)
    m = LinkMeasurement("gamer", "workstation", "a", "b", "ssh", "python", 1.0, {1: 1.5e9, 4: 2.0e9}, 3e-4, "now")
    store_link(topo.file, m)
    plan = plan_topology(topo, [256], 0)
    assert plan.link.measured and plan.link.usable_bps == 2.0e9 and plan.link.rtt_s == 3e-4
    assert not plan_topology(topo, [256], 0, use_probe=False).link.measured
    store_link(topo.file, LinkMeasurement("x", "y", "a", "b", "ssh", "python", 1.0, {1: 1e9}, 1e-4, "now"))
    plan = plan_topology(topo, [256], 0)
    assert not plan.link.measured
    assert any("ignored the probe-link result" in n for n in plan.notes)


def test_kv_cache_dtype_comes_from_decode_args() -> None:
    text = open("topologies/house-2g5.yaml").read().replace(
        'args: [--gpu-memory-utilization, "0.85"]', 'args: [--kv-cache-dtype, fp8]')
    plan = plan_topology(parse_topology(text, "h.yaml"), [1024], 0, use_probe=False)
    assert plan.kv_dtype == "fp8" and plan.classes[0].kv_bytes == 1024 * 65536


BASE = """\
model: meta-llama/Llama-3.1-8B-Instruct
link: {link}
hosts:
  p: {{address: 10.0.0.1, {p}}}
  d: {{address: 10.0.0.2, device: cuda, gpu: h100}}
roles:
  {roles}
"""
SPLIT = "{prefill: [{host: p, port: 8100}], decode: [{host: d, port: 8200}]}"


@pytest.mark.parametrize(("link_text", "p", "roles", "match"), [
    ("{type: ethernet, rate: 10gbit}", "device: cuda", SPLIT, "gpu: field"),
    ("{type: ethernet}", "device: cuda, gpu: h100", SPLIT, "link.rate is missing"),
    ("{type: ethernet, rate: 10gbit}", "device: cuda, gpu: h100", "{both: [{host: p, port: 8100}]}",
     "colocated"),
])
def test_plan_errors_say_what_to_add(link_text: str, p: str, roles: str, match: str) -> None:
    topo = parse_topology(BASE.format(link=link_text, p=p, roles=roles), "x.yaml")
    with pytest.raises(PlanError, match=match):
        plan_topology(topo, [256], 0)


def test_unlisted_rates_use_the_efficiency() -> None:
    topo = parse_topology(BASE.format(link="{type: ethernet, rate: 40gbit}", p="device: cuda, gpu: h100",
                                      roles=SPLIT), "x.yaml")
    assert plan_topology(topo, [256], 0).link.usable_bps == pytest.approx(0.94 * 40e9)


def test_fp8_on_the_wire_moves_about_half_and_memory_stays_the_cache_s() -> None:
    raw = make_plan(LLAMA, "bfloat16", link(2.35e9), prefill_rate(5000.0), MemoryEstimate(26e9, "26 GB"),
                    [2048], 256)
    fp8 = make_plan(LLAMA, "bfloat16", link(2.35e9), prefill_rate(5000.0), MemoryEstimate(26e9, "26 GB"),
                    [2048], 256, wire_format="fp8")
    # one float32 scale per 128 one-byte elements, over a 2-byte cache
    assert fp8.classes[0].kv_bytes == round(256 * MIB * (1 + 4 / 128) / 2)
    assert fp8.wire_bytes_per_token == pytest.approx(131072 * (1 + 4 / 128) / 2)
    assert fp8.classes[0].handoff_s == pytest.approx(PROXY_HOP_S + fp8.classes[0].kv_bytes * 8 / 2.35e9)
    assert fp8.classes[0].conversations == raw.classes[0].conversations == 86    # the cache is bf16 either way
    assert fp8.to_json()["wire_format"] == "fp8" and raw.to_json()["wire_format"] == "raw"


def test_fp8_plans_from_the_topology_and_as_a_what_if() -> None:
    topo = load_topology("topologies/local-cpu.yaml")
    assert topo.wire_format == "raw"
    what_if = plan_topology(topo, [2048], 0, use_probe=False, wire_format="fp8")
    assert what_if.wire_format == "fp8" and not any("socket connector's" in n for n in what_if.notes)
    nixl = plan_topology(load_topology("topologies/house-2g5.yaml"), [2048], 0, use_probe=False, wire_format="fp8")
    assert any("connector nixl sends the cache's own bytes" in n for n in nixl.notes)
    with pytest.raises(PlanError, match="KV cache fp8: wire_format fp8 needs a KV cache of 2 or 4 bytes"):
        plan_topology(topo, [2048], 0, use_probe=False, wire_format="fp8", kv_dtype="fp8")


def test_fp8_on_cpu_engines_is_priced_at_the_slower_of_link_and_conversion() -> None:
    """On CPU engines the fp8 conversions (about 500 MB/s of cache) are the limit above ~2.2 Gb/s:
    at 2.5 Gb/s the handoff moves the wire bytes at the conversions' rate, at 100 Mb/s at the
    link's; raw by the link alone; on GPU engines the device's conversions (about 11 GB/s of cache,
    one H200) limit only links faster than about 45 Gb/s."""
    text = Path("topologies/local-emulated-1g.yaml").read_text().replace(
        "connector: nixl", "connector: {type: socket, streaming: false}")
    ratio = 1 + 4 / 128
    for rate, limited in (("2.5gbit", True), ("100mbit", False)):
        topo = parse_topology(text.replace("rate: 1gbit", f"rate: {rate}"), "e.yaml")
        fp8 = plan_topology(topo, [2048], 0, use_probe=False, wire_format="fp8")
        raw = plan_topology(topo, [2048], 0, use_probe=False)
        wire = fp8.classes[0].kv_bytes
        link_bps = topo.link.rate_bps * 0.94 / 8
        expect = FP8_CPU_CONVERT_BYTES_PER_S * ratio / 2 if limited else link_bps
        assert fp8.link.bytes_per_s == pytest.approx(expect)
        assert fp8.classes[0].handoff_s == pytest.approx(
            fp8.link.fixed_s + wire / expect + fp8.link.first_step_kv_s(wire))
        assert any("the conversions, not the link" in n for n in fp8.notes) is limited
        assert raw.link.bytes_per_s == pytest.approx(link_bps) and raw.link.convert_wire_bps is None
        # the topology's own format (raw): the link with decode's first step read of the KV folded in
        assert route_seeds(topo).link_bytes_per_s == pytest.approx(raw.link.cost().bytes_per_s)
        assert raw.link.cost().bytes_per_s == pytest.approx(1 / (1 / link_bps + 1 / raw.link.first_step_wire_bps))
    # GPU engines convert on the device, measured far faster: the limit only on a very fast link
    for rate, limited in (("1gbit", False), ("100gbit", True)):
        gpu = parse_topology(text.replace("device: cpu", "device: cuda, gpu: rtx-4090")
                             .replace("rate: 1gbit", f"rate: {rate}"), "g.yaml")
        plan = plan_topology(gpu, [2048], 0, use_probe=False, wire_format="fp8")
        assert plan.link.convert_wire_bps == pytest.approx(FP8_GPU_CONVERT_BYTES_PER_S * ratio / 2)
        expect = FP8_GPU_CONVERT_BYTES_PER_S * ratio / 2 if limited else gpu.link.rate_bps * 0.94 / 8
        assert plan.link.bytes_per_s == pytest.approx(expect)
        assert any("GPU engines: the conversions, not the link" in n for n in plan.notes) is limited
    # a CPU engine on either side converts at its core's rate: the slower side sets it
    mixed = parse_topology(text.replace("box-d: {address: 198.18.10.2, device: cpu}",
                                        "box-d: {address: 198.18.10.2, device: cuda, gpu: rtx-4090}")
                           .replace("rate: 1gbit", "rate: 2.5gbit"), "m.yaml")
    assert {mixed.host_of(i).device for i in mixed.instances} == {"cpu", "cuda"}
    plan = plan_topology(mixed, [2048], 0, use_probe=False, wire_format="fp8")
    assert plan.link.bytes_per_s == pytest.approx(FP8_CPU_CONVERT_BYTES_PER_S * ratio / 2)
    assert any("on a CPU engine: the conversions, not the link" in n for n in plan.notes)


# --- a streamed handoff (the socket connector's streaming) ---------------------------------------

def test_streamed_plan_prices_only_what_the_prefill_does_not_hide() -> None:
    """LLAMA has 32 layers; on a 10 GB/s-usable link a 2,048-token prompt's 256 MiB take 215 ms,
    beside its 410 ms prefill, where the decode host would prefill it itself in 500 ms: MARGINAL when
    sent after the prefill (626 ms), and PAYS with only the last layer's send (a 32nd) left when
    streamed beside it."""
    args = (LLAMA, "bfloat16", link(10e9), prefill_rate(5000.0), MemoryEstimate(None, "?"), [2048], 0)
    seq = make_plan(*args, decode_prefill=prefill_rate(4096.0))
    streamed = make_plan(*args, streaming_layers=32, decode_prefill=prefill_rate(4096.0))
    s, t = seq.classes[0], streamed.classes[0]
    transfer = 256 * MIB * 8 / 10e9
    assert s.transfer_s == t.transfer_s == pytest.approx(transfer)
    assert s.exposed_s == s.transfer_s and s.handoff_s == pytest.approx(PROXY_HOP_S + transfer)
    assert t.exposed_s == pytest.approx(transfer / 32)
    assert t.handoff_s == pytest.approx(PROXY_HOP_S + transfer / 32)
    assert (s.verdict, t.verdict) == (MARGINAL, PAYS)
    assert "streaming 256 MiB (215 ms on the link alone) adds" in t.reason
    assert not seq.streaming and streamed.streaming and streamed.streaming_layers == 32
    # per token the sequential split (P's prefill + the transfer) is slower than D's own prefill: it
    # never pays; the streamed one does from a short prompt on
    assert seq.pays_from_tokens is None and seq.break_even_tokens is not None
    assert streamed.pays_from_tokens is not None and streamed.break_even_tokens is not None
    assert streamed.break_even_tokens <= seq.break_even_tokens
    n = streamed.pays_from_tokens
    for m, holds in ((n, True), (n - 1, False)):
        pre, x = m / 5000.0, LLAMA.kv_bytes(m) * 8 / 10e9
        assert (pre + PROXY_HOP_S + exposed_transfer_s(x, pre, 32) <= m / 4096.0) is holds
    data = streamed.to_json()
    assert data["streaming"] is True and data["streaming_layers"] == 32
    assert data["classes"][0]["transfer_s"] == t.transfer_s and data["classes"][0]["exposed_handoff_s"] == t.exposed_s
    assert seq.to_json()["streaming"] is False and seq.to_json()["streaming_layers"] is None


def test_a_streamed_split_that_does_not_pay_names_the_rate_that_would() -> None:
    # 256 MiB over 1 Gb/s take 2.15 s beside a 410 ms prefill: 1.75 s exposed, longer than the decode
    # host's own 819 ms prefill; to pay, P's prefill + the fixed cost + the exposed part must fit in
    # that 819 ms, i.e. a transfer of at most min(32 x budget, budget + prefill - prefill / 32)
    plan = make_plan(LLAMA, "bfloat16", link(1e9), prefill_rate(5000.0), MemoryEstimate(None, "?"), [2048], 0,
                     streaming_layers=32, decode_prefill=prefill_rate(2500.0))
    row = plan.classes[0]
    assert row.verdict == NO_PAY
    budget = 2048 / 2500.0 - 2048 / 5000.0 - PROXY_HOP_S
    longest = min(32 * budget, budget + 2048 / 5000.0 * (1 - 1 / 32))
    assert f"the link would need {fmt_rate(256 * MIB * 8 / longest)}" in row.reason


def _streaming_socket_topology():
    text = Path("topologies/local-cpu.yaml").read_text()
    assert "\nconnector: socket\n" in text
    return (parse_topology(text.replace("\nconnector: socket\n", "\nconnector: {type: socket, streaming: true}\n"),
                           "s.yaml", run_dir="/nonexistent/run"),
            parse_topology(text, "s.yaml", run_dir="/nonexistent/run"))


def test_streaming_plans_from_the_topology_and_as_a_what_if() -> None:
    streamed_topo, plain_topo = _streaming_socket_topology()
    plan = plan_topology(streamed_topo, [256, 2048], 0, use_probe=False)
    assert plan.streaming_layers == plan.model.layers == 2         # the embedded tiny model
    assert any(n.startswith("streamed handoff: ") and "L = 2 layers" in n for n in plan.notes)
    for c in plan.classes:
        assert c.handoff_s == pytest.approx(plan.link.fixed_s + exposed_transfer_s(c.transfer_s, c.prefill_s, 2))
        assert c.handoff_s < plan.link.fixed_s + c.transfer_s
    # the same topology without streaming, and each as the other's what-if
    plain = plan_topology(plain_topo, [256, 2048], 0, use_probe=False)
    assert plain.streaming_layers is None and not any("streamed" in n for n in plain.notes)
    # sent after the prefill: decode's first step (weights and the prompt's KV) comes after it
    assert [c.handoff_s for c in plain.classes] == pytest.approx([
        plain.link.fixed_s + c.transfer_s + plain.link.first_step_kv_s(c.kv_bytes) for c in plain.classes])
    assert plain.link.first_step_fixed_s > 0 and plan.link.first_step_fixed_s == 0
    assert plan_topology(plain_topo, [256, 2048], 0, use_probe=False, streaming=True).classes == plan.classes
    assert plan_topology(streamed_topo, [256, 2048], 0, use_probe=False, streaming=False).classes == plain.classes
    # what the proxy starts from
    assert route_seeds(streamed_topo).streaming_layers == 2 and route_seeds(plain_topo).streaming_layers is None


def test_streaming_is_refused_for_a_connector_that_cannot_stream() -> None:
    nixl = load_topology("topologies/house-2g5.yaml")
    with pytest.raises(PlanError, match=r"a streamed handoff is the socket connector's.*connector nixl sends"):
        plan_topology(nixl, [2048], 0, use_probe=False, streaming=True)
    assert plan_topology(nixl, [2048], 0, use_probe=False, streaming=False).streaming_layers is None


def test_a_sequential_handoff_adds_decodes_first_step_at_the_decode_hosts_memory_rate() -> None:
    """vLLM recomputes the last prompt token on the decode engine once the KV is in: the plan adds
    that step (active weights + the prompt's KV) at 3 GB/s per pinned CPU core, a GPU's spec-sheet
    bandwidth, or not at all (with a note) where the rate is unknown."""
    from disagg.routecost import FIRST_STEP_CPU_BYTES_PER_S, handoff_fixed_s

    text = Path("topologies/local-cpu.yaml").read_text()
    one = plan_topology(parse_topology(text, "a.yaml", run_dir="/nonexistent/run"), [2048], 0, use_probe=False)
    weights = one.model.active_params * 2                       # the tiny model, bf16
    assert one.link.first_step_fixed_s == pytest.approx(weights / FIRST_STEP_CPU_BYTES_PER_S)
    assert one.link.fixed_s == pytest.approx(3 * one.link.rtt_s + handoff_fixed_s("socket") + weights / 3e9)
    kv = one.model.kv_bytes(2048, one.kv_dtype)
    c = one.classes[0]
    assert c.handoff_s == pytest.approx(one.link.fixed_s + c.transfer_s + kv / 3e9)
    assert any(n.startswith("the handoff includes decode's first step") for n in one.notes)
    # two pinned cores: twice the rate
    two = plan_topology(parse_topology(text.replace("cpus: [1]", "cpus: [1, 2]"), "b.yaml", run_dir="/nonexistent/run"),
                        [2048], 0, use_probe=False)
    assert two.link.first_step_fixed_s == pytest.approx(one.link.first_step_fixed_s / 2)
    assert two.classes[0].handoff_s == pytest.approx(two.link.fixed_s + c.transfer_s + kv / 6e9)
    # unpinned: not priced, and said so
    free = plan_topology(parse_topology(text.replace(", cpus: [1]", ""), "c.yaml", run_dir="/nonexistent/run"),
                         [2048], 0, use_probe=False)
    assert free.link.first_step_fixed_s == 0 and free.link.first_step_wire_bps is None
    assert free.classes[0].handoff_s == pytest.approx(free.link.fixed_s + c.transfer_s)
    assert any("first step after the handoff is not priced" in n for n in free.notes)
    # a GPU decode host: its spec-sheet bandwidth
    gpu = plan_topology(parse_topology(text.replace("device: cpu", "device: cuda, gpu: h100"), "d.yaml",
                                       run_dir="/nonexistent/run"), [2048], 0, use_probe=False)
    assert gpu.link.first_step_fixed_s == pytest.approx(weights / 3350e9)
    assert gpu.link.first_step_wire_bps == pytest.approx(3350e9)


@pytest.mark.parametrize(("text", "bps"), [("5gbe", 5e9), ("2.5gb", 2.5e9), ("5gbit", 5e9), ("10gbit", 10e9),
                                           ("940mbit", 940e6), ("1.2GB/s", 9.6e9), ("10GbE", 10e9),
                                           ("2.5gbps", 2.5e9), ("100mbit/s", 100e6)])
def test_link_takes_any_line_rate(text: str, bps: float) -> None:
    from disagg.planning import link_class_estimate, parse_link_rate
    assert parse_link_rate(text) == pytest.approx(bps)
    assert link_class_estimate(text).usable_bps == pytest.approx(bps * 0.94)


@pytest.mark.parametrize(("text", "hint"), [("rocee-100g", "(did you mean 'roce-100g'?)"), ("fast", ""),
                                            ("10", "")])
def test_an_unknown_link_is_one_clear_error(text: str, hint: str) -> None:
    from disagg.planning import link_class_estimate
    with pytest.raises(PlanError, match=f"unknown link '{text}'; expected a link class") as info:
        link_class_estimate(text)
    assert str(info.value).endswith(hint or "1.2GB/s")


def test_a_stored_pair_handoff_replaces_the_seeded_fixed_cost(tmp_path) -> None:
    """Once `disagg bench compare` stored this pair's fixed cost, plan uses it (all of the fixed part:
    connector, first step over the weights, round trips), labelled with where and when; the part
    that grows with the KV stays priced as before."""
    from disagg.measurements import store_handoff
    from disagg.routecost import HANDOFF_FIXED_S

    topo = _copy_house(tmp_path)
    seeded = plan_topology(topo, [2048], 0, use_probe=False)
    assert seeded.link.connector_fixed_s == HANDOFF_FIXED_S["nixl"] and seeded.link.measured_fixed_s is None
    assert seeded.to_json()["handoff_fixed_source"].startswith("measured 2026-11-30 on a 2-core CPU machine")
    store_handoff(topo.run_dir, "meta-llama/Llama-3.1-8B-Instruct", "gamer", "workstation", "nixl", False, 0.120,
                  "test probe", measured_at="2026-12-04T10:00:00+00:00")
    plan = plan_topology(topo, [2048], 0, use_probe=False)
    assert plan.link.fixed_s == 0.120
    row, before = plan.classes[0], seeded.classes[0]
    assert row.handoff_s - 0.120 == pytest.approx(before.handoff_s - seeded.link.fixed_s)
    assert plan.to_json()["handoff_fixed_source"] == "measured on this pair 2026-12-04 (test probe)"
    assert route_seeds(topo).handoff_fixed_s == 0.120
    # another connector, or the pair the other way round, has no measurement of its own
    socket = replace_connector(topo, "socket")
    assert plan_topology(socket, [2048], 0, use_probe=False).link.measured_fixed_s is None
    # a what-if model reads other weights in decode's first step: the seed again
    assert plan_topology(topo, [2048], 0, use_probe=False, model="qwen3-8b").link.measured_fixed_s is None


def test_a_pair_s_handoff_probed_at_two_lengths_prices_each_byte_as_measured(tmp_path) -> None:
    """With the pair's measured line (fixed cost + seconds per wire byte), a handoff costs exactly
    that: the model's exposed transfer and first step's read give way to it, in the rows, the
    routing line (LinkCost) and the workload plan alike; the probe itself plans by the model."""
    from disagg.measurements import store_handoff

    topo = _copy_house(tmp_path)
    per_byte = 2e-9
    store_handoff(topo.run_dir, "meta-llama/Llama-3.1-8B-Instruct", "gamer", "workstation", "nixl", False, 0.030,
                  "two-length probe", exposed_per_byte_s=per_byte, points=[(1e6, 0.032), (8e6, 0.046)])
    plan = plan_topology(topo, [256, 2048], 0, use_probe=False)
    assert plan.link.measured_exposed_per_byte_s == per_byte
    for row in plan.classes:
        assert row.handoff_s == pytest.approx(0.030 + per_byte * row.kv_bytes)
        assert row.exposed_s == pytest.approx(per_byte * row.kv_bytes)
    cost = plan.link.cost()
    assert cost.exposed_per_byte_s == per_byte and cost.bytes_per_s == pytest.approx(plan.link.bytes_per_s)
    assert cost.after_prefill_s(4e6, 10.0) == pytest.approx(0.030 + per_byte * 4e6)
    modelled = plan_topology(topo, [256, 2048], 0, use_probe=False, use_measured_handoff=False)
    assert modelled.link.measured_exposed_per_byte_s is None and modelled.link.measured_fixed_s is None
    assert modelled.classes[1].handoff_s != pytest.approx(plan.classes[1].handoff_s)


def replace_connector(topo, connector: str):
    from dataclasses import replace as dc_replace
    return dc_replace(topo, connector=connector)


def test_plan_prints_the_pair_s_measured_handoff(tmp_path, capsys) -> None:
    from disagg.cli import main
    from disagg.measurements import store_handoff

    run = tmp_path / "run"
    house = tmp_path / "house.yaml"
    house.write_text(f"run_dir: {run}\n" + open("topologies/house-2g5.yaml").read())
    store_handoff(run, "meta-llama/Llama-3.1-8B-Instruct", "gamer", "workstation", "nixl", False, 0.120,
                  "test probe", measured_at="2026-12-04T10:00:00+00:00")
    assert main(["plan", str(house), "--no-probe", "--prompt-tokens", "2048"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "handoff 120 ms fixed per request: measured on this pair 2026-12-04 (test probe)" in out
    assert "the connector's own" not in out and "per MiB" not in out
    store_handoff(run, "meta-llama/Llama-3.1-8B-Instruct", "gamer", "workstation", "nixl", False, 0.120,
                  "test probe", measured_at="2026-12-04T10:00:00+00:00", exposed_per_byte_s=1e-9,
                  points=[(1e6, 0.121), (9e6, 0.129)])
    assert main(["plan", str(house), "--no-probe", "--prompt-tokens", "2048"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert ("(test probe); then 1.05 ms per MiB of KV moved, measured on this pair at two prompt lengths" in out), out
