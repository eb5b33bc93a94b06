"""routing: in the topology -> the proxy's options (disagg up hands them over) -> the proxy's config."""

from __future__ import annotations

from pathlib import Path

import pytest

from disagg.cli import build_parser
from disagg.deployment import build_deployment
from disagg.errors import TopologyError
from disagg.launch.frontend import proxy_config
from disagg.planning import plan_topology, route_seeds
from disagg.proxy.config import ProxyConfig
from disagg.routecost import handoff_fixed_s
from disagg.topology import parse_topology

ROOT = Path(__file__).resolve().parents[2]
#: the running test's own run_dir (:func:`_own_run_dir`)
_run_dir: list[Path] = []


@pytest.fixture(autouse=True)
def _own_run_dir(tmp_path: Path):  # type: ignore[no-untyped-def]
    """Each test's topology keeps its state in a run_dir of its own: the checkout's ``.disagg/``
    holds whatever a developer's ``disagg bench prefill`` measured there, which ``plan`` reads."""
    _run_dir.append(tmp_path / "run")
    yield
    _run_dir.pop()


def topology(extra: str = "", connector: str = "nixl", file: str = "t.yaml"):  # type: ignore[no-untyped-def]
    text = (ROOT / "topologies" / "local-cpu-nixl.yaml").read_text()
    text = text.replace("connector: nixl", f"connector: {connector}")
    if "run_dir:" not in extra:
        extra += f"run_dir: {_run_dir[-1]}\n"
    return parse_topology(text + extra, str(ROOT / "topologies" / file))


def test_policy_defaults_to_auto_and_is_checked() -> None:
    assert topology().routing.policy == "auto"
    assert topology("routing: {policy: split}\n").routing.policy == "split"
    with pytest.raises(TopologyError, match=r"routing.policy: expected one of auto, split, local"):
        topology("routing: {policy: fastest}\n")
    with pytest.raises(TopologyError, match="did you mean 'policy'"):
        topology("routing: {polcy: auto}\n")


@pytest.mark.parametrize("connector", ["nixl", "socket"])
def test_auto_hands_the_plan_figures_to_the_proxy(connector: str) -> None:
    topo = topology(connector=connector)
    config = proxy_config(build_deployment(topo))
    seeds, plan = route_seeds(topo), plan_topology(topo, [], 0)
    r = config.routing
    assert (r.policy, r.whole) == ("auto", True)
    assert r.kv_bytes_per_token == plan.model.kv_bytes_per_token(plan.kv_dtype) == seeds.kv_bytes_per_token
    assert r.handoff_fixed_s == pytest.approx(plan.link.fixed_s)
    assert plan.link.fixed_s >= handoff_fixed_s(connector)
    assert r.link_bytes_per_s == pytest.approx(plan.link.cost().bytes_per_s)   # decode's first step folded in
    assert plan.link.cost().bytes_per_s < plan.link.usable_bps / 8
    assert r.prefill_tokens_per_s == pytest.approx(plan.prefill.rate())
    # through the command line and back: what `disagg up` starts is what it planned
    args = build_parser().parse_args(config.to_argv(with_api_key=False))
    assert ProxyConfig.from_args(args).routing == r


def test_the_proxy_is_told_which_seed_rates_were_measured(tmp_path: Path) -> None:
    """A host's stored prefill rate is a measurement; a host without one is seeded with an
    estimate: the proxy scales only estimates by what it measures (Measurements._line)."""
    from disagg.engines.vllm import served_model_name
    from disagg.measurements import store_prefill

    topo = topology(f"run_dir: {tmp_path}\n")
    assert route_seeds(topo).measured_rates == ()
    store_prefill(tmp_path, served_model_name(topo), "local", 1127.0, "test")
    topo = topology(f"run_dir: {tmp_path}\n")
    seeds = route_seeds(topo)
    assert seeds.measured_rates == ("prefill", "decode")        # local-cpu-nixl.yaml: one host plays both roles
    config = proxy_config(build_deployment(topo))
    assert config.routing.measured_rates == ("prefill", "decode")
    argv = config.to_argv(with_api_key=False)
    assert argv[argv.index("--route-measured-rates") + 1] == "prefill,decode"
    assert ProxyConfig.from_args(build_parser().parse_args(argv)).routing == config.routing
    with pytest.raises(SystemExit):
        build_parser().parse_args([*argv, "--route-measured-rates", "prefill,both"])
    from disagg.errors import ProxyError
    from disagg.proxy.config import RoutingConfig

    with pytest.raises(ProxyError, match="measured_rates"):
        RoutingConfig(measured_rates=("both",))
    with pytest.raises(ProxyError, match="no decode rate"):
        RoutingConfig(measured_rates=("decode",), prefill_tokens_per_s=1000.0)


def test_a_role_counts_as_measured_only_when_every_host_of_it_was(tmp_path: Path) -> None:
    """Every engine of a role is seeded with its first host's rate: it is taken as measured only
    when each host of the role has a stored rate of its own."""
    from disagg.engines.vllm import served_model_name
    from disagg.measurements import store_prefill

    text = f"""model: {{path: "disagg:tiny"}}
engine: vllm
connector: socket
link: {{type: loopback}}
run_dir: {tmp_path}
hosts:
  p: {{address: 127.0.0.1, device: cpu}}
  d1: {{address: 127.0.0.2, device: cpu}}
  d2: {{address: 127.0.0.3, device: cpu}}
roles:
  prefill:
    - {{host: p, port: 8100, kv_port: 5601}}
  decode:
    - {{host: d1, port: 8200, kv_port: 5602}}
    - {{host: d2, port: 8201, kv_port: 5603}}
"""
    topo = parse_topology(text, str(tmp_path / "t.yaml"))
    model = served_model_name(topo)
    for host in ("p", "d1"):
        store_prefill(tmp_path, model, host, 1100.0, "test")
    assert route_seeds(topo).measured_rates == ("prefill",)      # d2 has no rate of its own
    store_prefill(tmp_path, model, "d2", 900.0, "test")
    assert route_seeds(topo).measured_rates == ("prefill", "decode")


def test_split_and_local_carry_no_seeds_and_split_adds_no_options() -> None:
    split = proxy_config(build_deployment(topology("routing: {policy: split}\n")))
    assert split.routing.policy == "split" and "--routing-policy" not in split.to_argv()
    local = proxy_config(build_deployment(topology("routing: {policy: local}\n")))
    argv = local.to_argv()
    assert argv[argv.index("--routing-policy") + 1] == "local"
    assert ProxyConfig.from_args(build_parser().parse_args(argv)).routing.policy == "local"


def test_plan_prints_the_idle_break_even_the_policy_uses(tmp_path: Path) -> None:
    from disagg.commands.plan import render_plan
    from disagg.kvmath import BUILTIN_MODELS
    from disagg.planning import LinkEstimate, MemoryEstimate, PrefillEstimate, make_plan
    from disagg.routecost import break_even_tokens

    arch = BUILTIN_MODELS["llama-3.1-8b"]
    fast, slow = (PrefillEstimate("t", estimated=False, arch=arch, tokens_per_s=r) for r in (8000.0, 1000.0))
    link = LinkEstimate(10e9, 1e-4, "test link", measured=False, connector_fixed_s=handoff_fixed_s("socket"))
    plan = make_plan(arch, "bfloat16", link, fast, MemoryEstimate(None, "?"), [256], 0, decode_prefill=slow)
    expected = break_even_tokens(lambda n: arch.kv_bytes(n, "bfloat16"), fast.cost(), slow.cost(), link.cost())
    assert expected is not None and plan.idle_split_from_tokens == expected
    assert plan.to_json()["idle_split_from_prompt_tokens"] == expected
    # alike hosts: never at idle, and plan says so for a real topology
    topo = topology()
    text = render_plan(plan_topology(topo, [128], 0), topo)
    assert "Routing (auto) at idle load: every prompt stays local" in text
    assert "handoff" in text and "benchmarks/handoff_fixed_cost.py" in text


def test_exploration_is_set_in_the_topology_and_reaches_the_proxy() -> None:
    r = topology().routing
    assert (r.explore_after_s, r.explore_decisions, r.explore_within) == (60.0, 50, 2.0)
    topo = topology("routing: {policy: auto, explore: {after: 5m, decisions: 200, within: 1.5}}\n")
    assert (topo.routing.explore_after_s, topo.routing.explore_decisions, topo.routing.explore_within) == \
        (300.0, 200, 1.5)
    config = proxy_config(build_deployment(topo))
    assert (config.routing.explore_after_s, config.routing.explore_decisions, config.routing.explore_within) == \
        (300.0, 200, 1.5)
    args = build_parser().parse_args(config.to_argv(with_api_key=False))
    assert ProxyConfig.from_args(args).routing == config.routing
    assert topology("routing: {explore: off}\n").routing.explore_within == 0.0
    assert topology("routing: {explore: {decisions: 10}}\n").routing.explore_decisions == 10
    with pytest.raises(TopologyError, match=r"routing.explore.within: expected a number greater than 1"):
        topology("routing: {explore: {within: 0.5}}\n")
    with pytest.raises(TopologyError, match=r"routing.explore: expected off, or a mapping"):
        topology("routing: {explore: sometimes}\n")
    with pytest.raises(TopologyError, match="did you mean 'decisions'"):
        topology("routing: {explore: {decision: 10}}\n")


def test_an_slo_in_the_topology_reaches_the_proxy_and_is_checked() -> None:
    assert topology().routing.slo_ttft_s is None and proxy_config(build_deployment(topology())).routing.slo is None
    topo = topology("routing: {policy: auto, slo: {ttft: 2s, tpot: 50ms}}\n")
    assert (topo.routing.slo_ttft_s, topo.routing.slo_tpot_s) == (2.0, 0.05)
    config = proxy_config(build_deployment(topo))
    assert (config.routing.slo_ttft_s, config.routing.slo_tpot_s) == (2.0, 0.05)
    argv = config.to_argv()
    assert argv[argv.index("--route-slo-tpot") + 1] == "0.05"
    assert ProxyConfig.from_args(build_parser().parse_args(argv)).routing == config.routing
    assert topology("routing: {slo: {tpot: 25ms}}\n").routing.slo_ttft_s is None
    with pytest.raises(TopologyError, match=r"routing.slo: expected ttft and/or tpot"):
        topology("routing: {slo: {}}\n")
    with pytest.raises(TopologyError, match=r"routing.slo.ttft: expected a duration"):
        topology("routing: {slo: {ttft: soon}}\n")
    with pytest.raises(TopologyError, match="did you mean 'tpot'"):
        topology("routing: {slo: {tpop: 25ms}}\n")
    with pytest.raises(TopologyError, match="an SLO steers only the auto policy"):
        topology("routing: {policy: split, slo: {ttft: 1s}}\n")
