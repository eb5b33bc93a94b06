"""routing: in the topology -> the proxy's options (disagg up hands them over) -> the proxy's config."""

from __future__ import annotations

from pathlib import Path

import pytest

from disagg.cli import build_parser
from disagg.commands.proxy import config_from_args
from disagg.deployment import plan_deployment
from disagg.errors import TopologyError
from disagg.launch.frontend import proxy_config
from disagg.planning import plan_topology, route_seeds
from disagg.routecost import handoff_fixed_s
from disagg.topology import parse_topology

ROOT = Path(__file__).resolve().parents[2]


def topology(extra: str = "", connector: str = "nixl", file: str = "t.yaml"):  # type: ignore[no-untyped-def]
    text = (ROOT / "topologies" / "local-cpu.yaml").read_text().replace("connector: nixl", f"connector: {connector}")
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
    config = proxy_config(plan_deployment(topo))
    seeds, plan = route_seeds(topo), plan_topology(topo, [], 0)
    r = config.routing
    assert (r.policy, r.whole) == ("auto", True)
    assert r.kv_bytes_per_token == plan.model.kv_bytes_per_token(plan.kv_dtype) == seeds.kv_bytes_per_token
    assert r.handoff_fixed_s == pytest.approx(plan.link.fixed_s)
    assert plan.link.fixed_s >= handoff_fixed_s(connector)
    assert r.link_bytes_per_s == pytest.approx(plan.link.usable_bps / 8)
    assert r.prefill_tokens_per_s == pytest.approx(plan.prefill.rate())
    # through the command line and back: what `disagg up` starts is what it planned
    args = build_parser().parse_args(config.to_argv(with_api_key=False))
    assert config_from_args(args).routing == r


def test_split_and_local_carry_no_seeds_and_split_adds_no_options() -> None:
    split = proxy_config(plan_deployment(topology("routing: {policy: split}\n")))
    assert split.routing.policy == "split" and "--routing-policy" not in split.to_argv()
    local = proxy_config(plan_deployment(topology("routing: {policy: local}\n")))
    argv = local.to_argv()
    assert argv[argv.index("--routing-policy") + 1] == "local"
    assert config_from_args(build_parser().parse_args(argv)).routing.policy == "local"
