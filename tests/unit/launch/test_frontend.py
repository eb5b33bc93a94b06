"""The front door's command line per proxy.kind (builtin proxy, vllm-router, sglang-router)."""

from __future__ import annotations

import textwrap

import pytest

from disagg.deployment import build_deployment
from disagg.errors import DeploymentError, TopologyError
from disagg.launch.frontend import frontend_argv, proxy_config
from disagg.topology import parse_topology

TEXT = """\
model: {path: /models/m}
engine: ENGINE
connector: CONNECTOR
proxy: {host: 127.0.0.1, port: 9000, kind: KIND}
hosts: {h: {address: 127.0.0.1}}
roles:
  prefill:
    - {host: h, port: 8100, kv_port: 8998}
    - {host: h, port: 8101, kv_port: 8999}
  decode:
    - {host: h, port: 8200}
"""


def argv(kind: str = "builtin", engine: str = "vllm", connector: str = "nixl", text: str = TEXT) -> list[str]:
    topo = parse_topology(textwrap.dedent(text).replace("ENGINE", engine).replace("CONNECTOR", connector)
                          .replace("KIND", kind), "t.yaml", run_dir="/tmp/run")
    return frontend_argv(build_deployment(topo))


def test_builtin_vllm_has_no_handoff_options() -> None:
    a = argv()
    assert a[1:4] == ["-m", "disagg", "proxy"] and "--handoff-option" not in a
    assert a[a.index("--prefill") + 1:a.index("--prefill") + 3] == ["http://127.0.0.1:8100", "http://127.0.0.1:8101"]


def test_builtin_sglang_passes_bootstrap_ports_in_prefill_order() -> None:
    a = argv(engine="sglang", connector="mooncake")
    assert a[a.index("--handoff") + 1] == "sglang"
    assert a[a.index("--handoff-option") + 1] == "bootstrap_ports=8998,8999"


def test_builtin_argv_rebuilds_the_topologys_proxy_config_without_the_api_key(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from disagg.cli import build_parser
    from disagg.proxy.config import API_KEY_ENV, ProxyConfig

    text = TEXT.replace("kind: KIND}", "kind: builtin, api_key: s3cret}")
    topo = parse_topology(text.replace("ENGINE", "sglang").replace("CONNECTOR", "mooncake"), "t.yaml",
                          run_dir="/tmp/run")
    dep = build_deployment(topo)
    a = frontend_argv(dep)
    assert "s3cret" not in a and "--api-key" not in a
    monkeypatch.setenv(API_KEY_ENV, "s3cret")  # what the launcher puts in the proxy's environment
    assert ProxyConfig.from_args(build_parser().parse_args(a[3:])) == proxy_config(dep)


def test_vllm_router_pd_flags() -> None:
    a = argv(kind="vllm-router")
    assert a[1:3] == ["-m", "vllm_router.launch_router"]
    assert a[3:] == ["--host", "127.0.0.1", "--port", "9000", "--vllm-pd-disaggregation",
                     "--prefill", "http://127.0.0.1:8100", "--prefill", "http://127.0.0.1:8101",
                     "--decode", "http://127.0.0.1:8200"]


def test_sglang_router_pd_flags_carry_bootstrap_ports() -> None:
    a = argv(kind="sglang-router", engine="sglang", connector="mooncake")
    assert a[1:3] == ["-m", "sglang_router.launch_router"]
    assert a[7:] == ["--pd-disaggregation", "--prefill", "http://127.0.0.1:8100", "8998",
                     "--prefill", "http://127.0.0.1:8101", "8999", "--decode", "http://127.0.0.1:8200"]


def test_router_for_the_other_engine_is_refused() -> None:
    with pytest.raises(DeploymentError, match=r"proxy\.kind sglang-router routes engine sglang"):
        argv(kind="sglang-router")
    with pytest.raises(DeploymentError, match=r"connector lmcache needs proxy\.kind builtin"):
        argv(kind="vllm-router", connector="lmcache")


def test_colocated_router_gets_worker_urls() -> None:
    text = """\
    model: {path: /models/m}
    proxy: {kind: vllm-router}
    hosts: {h: {address: 127.0.0.1}}
    roles: {both: [{host: h, port: 8300}, {host: h, port: 8301}]}
    """
    assert argv(text=text)[-3:] == ["--worker-urls", "http://127.0.0.1:8300", "http://127.0.0.1:8301"]


def test_unknown_kind_names_the_choices() -> None:
    with pytest.raises(TopologyError, match="sglang-router"):
        argv(kind="nginx")


def test_proxy_config_from_topology() -> None:
    text = """
model: {path: disagg:tiny}
engine: vllm
connector: nixl
proxy: {host: 127.0.0.1, port: 8010, fallback: never, api_key: k, max_concurrency: 64, log_level: debug}
timeouts: {request: 30}
hosts:
  a: {address: 127.0.0.1}
roles:
  prefill: [{host: a, port: 8100}, {host: a, port: 8101}]
  decode: [{host: a, port: 8200}]
"""
    cfg = proxy_config(build_deployment(parse_topology(text, "t.yaml")))
    assert cfg.prefill == ("http://127.0.0.1:8100", "http://127.0.0.1:8101")
    assert cfg.decode == ("http://127.0.0.1:8200",)
    assert (cfg.port, cfg.fallback, cfg.api_key, cfg.timeouts.request) == (8010, "never", "k", 30)
    assert cfg.max_concurrency == 64
    assert cfg.log_level == "debug" and cfg.to_argv()[-2:] == ["--log-level", "debug"]
    with pytest.raises(TopologyError, match=r"t.yaml:5.*expected one of info, debug, got 'trace'"):
        parse_topology(text.replace("log_level: debug", "log_level: trace"), "t.yaml")


def test_every_proxy_wait_comes_from_the_topologys_timeouts() -> None:
    text = TEXT.replace("ENGINE", "vllm").replace("CONNECTOR", "nixl").replace("KIND", "builtin") + (
        "timeouts: {connect: 3, request: 30, health_interval: 0.5, health_timeout: 1.5, drain: 4}\n")
    cfg = proxy_config(build_deployment(parse_topology(text, "t.yaml", run_dir="/tmp/run")))
    t = cfg.timeouts
    assert (t.connect, t.request, t.health_interval, t.health_timeout, t.drain) == (3, 30, 0.5, 1.5, 4)
    a = cfg.to_argv(with_api_key=False)
    assert a[a.index("--health-timeout") + 1] == "1.5" and a[a.index("--drain-timeout") + 1] == "4.0"


STREAMING = """\
model: {path: /models/m}
engine: vllm
connector: {type: socket, streaming: STREAMING}
link: {type: ethernet, rate: 10gbit}
proxy: {host: 127.0.0.1, port: 9000}
routing: {policy: split}
hosts:
  a: {address: 10.0.0.1}
  v6: {address: "fd00::7"}
  d: {address: 10.0.0.2}
roles:
  prefill:
    - {host: v6, port: 8100, kv_port: 5702}
    - {host: a, port: 8101, kv_port: 5701}
    - {host: a, port: 8102, kv_port: 5700}
  decode:
    - {host: d, port: 8200}
"""


def test_socket_streaming_gets_the_stream_handoff_and_each_prefills_listener_in_prefill_order() -> None:
    from disagg.cli import build_parser
    from disagg.launch.frontend import handoff_kind, handoff_options
    from disagg.proxy.config import ProxyConfig
    from disagg.proxy.socket_stream_handoff import KvPeer, SocketStreamHandoff, parse_kv_peers

    dep = build_deployment(parse_topology(STREAMING.replace("STREAMING", "true"), "t.yaml", run_dir="/tmp/run"))
    assert handoff_kind(dep) == "vllm-socket-stream" == SocketStreamHandoff.kind
    assert handoff_options(dep) == (("kv_peers", "[fd00::7]:5702,10.0.0.1:5701,10.0.0.1:5700"),)
    cfg = proxy_config(dep)
    assert cfg.prefill == ("http://[fd00::7]:8100", "http://10.0.0.1:8101", "http://10.0.0.1:8102")
    # what the proxy makes of it: each --prefill URL's own listener
    assert parse_kv_peers(cfg.prefill, dict(cfg.handoff_options)["kv_peers"]) == {
        "http://[fd00::7]:8100": KvPeer("fd00::7", 5702), "http://10.0.0.1:8101": KvPeer("10.0.0.1", 5701),
        "http://10.0.0.1:8102": KvPeer("10.0.0.1", 5700)}
    assert ProxyConfig.from_args(build_parser().parse_args(frontend_argv(dep)[3:])) == cfg


def test_socket_without_streaming_keeps_the_vllm_handoff() -> None:
    from disagg.launch.frontend import handoff_kind, handoff_options

    dep = build_deployment(parse_topology(STREAMING.replace("STREAMING", "false"), "t.yaml", run_dir="/tmp/run"))
    assert (handoff_kind(dep), handoff_options(dep)) == ("vllm", ())
    # left out, streaming is on here: no prefill instance shares a host with a decode instance
    plain = STREAMING.replace("{type: socket, streaming: STREAMING}", "socket")
    assert handoff_kind(build_deployment(parse_topology(plain, "t.yaml", run_dir="/tmp/run"))) == "vllm-socket-stream"


def test_socket_streaming_routing_prices_splits_streamed_over_the_models_layers() -> None:
    from dataclasses import replace

    from disagg.cli import build_parser
    from disagg.kvmath import BUILTIN_MODELS
    from disagg.launch.frontend import routing_config
    from disagg.proxy.config import ProxyConfig

    text = STREAMING.replace("routing: {policy: split}\n", "").replace("/models/m", "qwen3-8b")
    on, off = (routing_config(build_deployment(parse_topology(text.replace("STREAMING", s), "t.yaml",
                                                              run_dir="/tmp/run")))
               for s in ("true", "false"))
    assert on.streaming_layers == BUILTIN_MODELS["qwen3-8b"].layers == 36 and off.streaming_layers is None
    # a streamed handoff's own fixed cost (routecost.STREAMED_HANDOFF_FIXED_S), the rest as without
    assert on.handoff_fixed_s is not None and off.handoff_fixed_s is not None
    assert on.handoff_fixed_s - off.handoff_fixed_s == pytest.approx(0.040 - 0.016)
    assert replace(on, streaming_layers=None, handoff_fixed_s=off.handoff_fixed_s) == off
    assert on.whole and on.policy == "auto"
    dep = build_deployment(parse_topology(text.replace("STREAMING", "true"), "t.yaml", run_dir="/tmp/run"))
    argv = frontend_argv(dep)
    assert argv[argv.index("--route-streaming-layers") + 1] == "36"
    assert ProxyConfig.from_args(build_parser().parse_args(argv[3:])) == proxy_config(dep)
    # a static policy has nothing to price
    split = text.replace("STREAMING", "true") + "routing: {policy: split}\n"
    assert routing_config(build_deployment(parse_topology(split, "t.yaml", run_dir="/tmp/run"))).streaming_layers \
        is None


def test_colocated_socket_streaming_is_a_plain_balancer() -> None:
    from disagg.launch.frontend import handoff_kind, handoff_options

    text = """\
    model: {path: /models/m}
    connector: {type: socket, streaming: true}
    hosts: {h: {address: 127.0.0.1}}
    roles: {both: [{host: h, port: 8300}]}
    """
    dep = build_deployment(parse_topology(textwrap.dedent(text), "t.yaml", run_dir="/tmp/run"))
    assert (handoff_kind(dep), handoff_options(dep)) == ("vllm", ())


def test_vllm_router_refuses_socket_streaming() -> None:
    text = STREAMING.replace("STREAMING", "true").replace("port: 9000}", "port: 9000, kind: vllm-router}")
    with pytest.raises(DeploymentError, match=r"connector socket needs proxy\.kind builtin"):
        frontend_argv(build_deployment(parse_topology(text, "t.yaml", run_dir="/tmp/run")))


def test_nixl_push_gets_the_push_handoff_with_no_options() -> None:
    from disagg.cli import build_parser
    from disagg.launch.frontend import handoff_kind, handoff_options
    from disagg.proxy.config import ProxyConfig
    from disagg.proxy.nixl_push_handoff import NixlPushHandoff

    text = textwrap.dedent(TEXT).replace("ENGINE", "vllm").replace("CONNECTOR", "nixl-push").replace("KIND", "builtin")
    dep = build_deployment(parse_topology(text, "t.yaml", run_dir="/tmp/run"))
    assert handoff_kind(dep) == "vllm-nixl-push" == NixlPushHandoff.kind
    assert handoff_options(dep) == ()                    # the proxy learns each prefill engine from its replies
    a = frontend_argv(dep)
    assert a[a.index("--handoff") + 1] == "vllm-nixl-push" and "--handoff-option" not in a
    assert ProxyConfig.from_args(build_parser().parse_args(a[3:])) == proxy_config(dep)
    # routing auto: no "whole" path (a prefill engine serving alone) where real engines have not proven it
    known = {c: proxy_config(build_deployment(parse_topology(text.replace("/models/m", "qwen3-8b").replace(
        "connector: nixl-push", f"connector: {c}"), "t.yaml", run_dir="/tmp/run"))).routing
        for c in ("nixl", "nixl-push")}
    assert known["nixl"].policy == known["nixl-push"].policy == "auto"
    assert known["nixl"].whole and not known["nixl-push"].whole


def test_colocated_nixl_push_is_a_plain_balancer() -> None:
    from disagg.launch.frontend import handoff_kind

    text = """\
    model: {path: /models/m}
    connector: nixl-push
    hosts: {h: {address: 127.0.0.1}}
    roles: {both: [{host: h, port: 8300}]}
    """
    assert handoff_kind(build_deployment(parse_topology(textwrap.dedent(text), "t.yaml", run_dir="/tmp/run"))) == "vllm"


def test_vllm_router_refuses_nixl_push() -> None:
    with pytest.raises(DeploymentError, match=r"connector nixl-push needs proxy\.kind builtin"):
        argv(kind="vllm-router", connector="nixl-push")


def test_sglang_refuses_nixl_push() -> None:
    with pytest.raises(DeploymentError, match="connector 'nixl-push' does not work with engine sglang"):
        argv(engine="sglang", connector="nixl-push")


def test_a_topology_without_timeouts_gives_the_proxy_its_own_defaults() -> None:
    """One owner for the proxy's waits (disagg.serving): a topology's defaults are the flags' defaults,
    so `up` passes no timeout flag unless the file sets one."""
    from disagg.proxy.config import ProxyTimeouts

    topo = parse_topology(TEXT.replace("ENGINE", "vllm").replace("CONNECTOR", "nixl").replace("KIND", "builtin"),
                          "t.yaml", run_dir="/tmp/run")
    assert proxy_config(build_deployment(topo)).timeouts == ProxyTimeouts()
    assert not any(a.endswith("-timeout") or a == "--health-interval" for a in argv())
