"""`connector: socket` planning: kv-transfer-config and env for both roles."""

from __future__ import annotations

import json
import textwrap

import pytest

from disagg.deployment import build_deployment
from disagg.errors import DeploymentError, TopologyError
from disagg.kv.socket import SECRET_ENV, SocketVllmAdapter, prefill_peer
from disagg.registry import vllm_kv_adapter
from disagg.topology import default_streaming, parse_topology

TOPO = """\
model: {path: disagg:tiny, max_model_len: 2048}
engine: vllm
connector: socket
link: {type: ethernet, rate: 2.5gbit}
hosts:
  a: {address: 198.18.0.1}
  b: {address: 198.18.0.2}
roles:
  prefill:
    - {host: a, port: 8100, kv_port: 5701}
  decode:
    - {host: b, port: 8200}
"""


def plan():
    topo = parse_topology(textwrap.dedent(TOPO), "topo.yaml", run_dir="/tmp/run")
    return {e.instance.role: e for e in build_deployment(topo).engines}


def kv_config(launch) -> dict:
    argv = list(launch.argv)
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])


def test_registry_names_socket() -> None:
    assert vllm_kv_adapter("socket").name == "socket"


def test_prefill_listens_on_its_link_address_and_kv_port() -> None:
    engines = plan()
    cfg = kv_config(engines["prefill"])
    assert cfg == {
        "kv_connector": "SocketKVConnector",
        "kv_connector_module_path": "disagg_connectors.socket_connector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"secret_env": SECRET_ENV, "host": "198.18.0.1", "port": 5701,
                                     "allowed_peers": ["198.18.0.2"]},
    }
    assert SECRET_ENV not in dict(engines["prefill"].env)  # per run: added by the launcher, never planned


def test_decode_recomputes_on_failed_fetch_and_names_its_prefill_peers() -> None:
    engines = plan()
    cfg = kv_config(engines["decode"])
    assert cfg == {
        "kv_connector": "SocketKVConnector",
        "kv_connector_module_path": "disagg_connectors.socket_connector",
        "kv_role": "kv_consumer",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"secret_env": SECRET_ENV, "peers": ["198.18.0.1:5701"]},
    }


TWO_PREFILL = """\
model: {path: disagg:tiny, max_model_len: 2048}
engine: vllm
connector: socket
link: {type: ethernet, rate: 10gbit}
hosts:
  a: {address: 198.18.0.1}
  v6: {address: "fd00::7"}
  b: {address: 198.18.0.2}
roles:
  prefill:
    - {host: a, port: 8100, kv_port: 5701}
    - {host: v6, port: 8101}
  decode:
    - {host: b, port: 8200}
    - {host: b, port: 8201}
"""


def test_every_decode_instance_may_fetch_from_every_prefill_listener() -> None:
    """The peers the planner writes are exactly what the connector's own config parser accepts."""
    from disagg_connectors.socket_connector.config import SocketSettings

    topo = parse_topology(TWO_PREFILL, "topo.yaml", run_dir="/tmp/run")
    launches = build_deployment(topo).engines
    prefill = [e for e in launches if e.instance.role == "prefill"]
    decode = [e for e in launches if e.instance.role == "decode"]
    listeners = [(kv_config(e)["kv_connector_extra_config"]["host"], kv_config(e)["kv_connector_extra_config"]["port"])
                 for e in prefill]
    assert listeners[0] == ("198.18.0.1", 5701) and listeners[1][0] == "fd00::7"
    for e in decode:
        extra = kv_config(e)["kv_connector_extra_config"]
        assert extra["peers"] == ["198.18.0.1:5701", f"[fd00::7]:{listeners[1][1]}"]
        settings = SocketSettings.load(extra, {SECRET_ENV: "5e" * 32})
        for host, port in listeners:  # what each prefill engine advertises as remote_host/remote_port
            assert settings.peers.allows(host, port)
        assert not settings.peers.allows("198.18.0.2", 5701)



def test_generated_secrets_are_long_and_fresh() -> None:
    topo = parse_topology(textwrap.dedent(TOPO), "t.yaml")
    a, b = SocketVllmAdapter().run_env(topo), SocketVllmAdapter().run_env(topo)
    assert a.keys() == b.keys() == {SECRET_ENV} and a != b and len(a[SECRET_ENV]) == 64


def _fp8_topology(decode_args: str = "") -> str:
    text = textwrap.dedent(TOPO).replace("connector: socket", "connector: {type: socket, wire_format: fp8}")
    return text.replace("- {host: b, port: 8200}", "- {host: b, port: 8200" + decode_args + "}")


def test_wire_format_fp8_reaches_both_engines() -> None:
    topo = parse_topology(_fp8_topology(), "topo.yaml", run_dir="/tmp/run")
    assert (topo.connector, topo.wire_format) == ("socket", "fp8")
    for launch in build_deployment(topo).engines:
        assert kv_config(launch)["kv_connector_extra_config"]["wire_format"] == "fp8"
    # raw (the default) is not spelled out: the engines' config is what it was before wire formats
    for launch in plan().values():
        assert "wire_format" not in kv_config(launch)["kv_connector_extra_config"]


def test_fp8_on_the_wire_over_an_fp8_cache_is_refused_before_any_engine_starts() -> None:
    topo = parse_topology(_fp8_topology(", args: [--kv-cache-dtype, fp8]"), "topo.yaml", run_dir="/tmp/run")
    with pytest.raises(DeploymentError, match=r"decode\[0\] \(line \d+\): connector.wire_format fp8 needs a 16- or "
                                              r"32-bit KV cache, not --kv-cache-dtype fp8"):
        build_deployment(topo)


@pytest.mark.parametrize(("connector", "message"), [
    ("{type: nixl, wire_format: fp8}", "wire_format fp8 needs connector type socket"),
    ("{type: socket, wire_format: int4}", "expected one of raw, fp8, got 'int4'"),
    ("{type: socket, wire: fp8}", "connector.wire: unknown field"),
])
def test_bad_wire_formats_are_refused_with_the_line(connector: str, message: str) -> None:
    with pytest.raises(TopologyError, match=r"topo.yaml:3: .*" + message):
        parse_topology(textwrap.dedent(TOPO).replace("connector: socket", f"connector: {connector}"), "topo.yaml")


@pytest.mark.parametrize(("connector", "streaming"), [
    ("socket", True),                       # prefill and decode on different hosts: streamed by default
    ("{type: socket}", True),
    ("{type: socket, streaming: true}", True),
    ("{type: socket, streaming: false}", False),
    ("{type: socket, streaming: null}", True),
    ("{type: socket, wire_format: fp8, streaming: true}", True),
])
def test_streaming_is_a_socket_connector_setting(connector: str, streaming: bool) -> None:
    topo = parse_topology(textwrap.dedent(TOPO).replace("connector: socket", f"connector: {connector}"), "topo.yaml")
    assert (topo.connector, topo.streaming) == ("socket", streaming)


def test_streaming_defaults_on_only_across_hosts() -> None:
    one_host = textwrap.dedent(TOPO).replace("{host: b, port: 8200}", "{host: a, port: 8200}")
    assert parse_topology(one_host, "topo.yaml").streaming is False
    assert parse_topology(one_host.replace("connector: socket", "connector: {type: socket, streaming: true}"),
                          "topo.yaml").streaming is True
    nixl = parse_topology(textwrap.dedent(TOPO).replace("connector: socket", "connector: nixl"), "topo.yaml")
    assert nixl.streaming is False
    assert default_streaming("socket", "sglang", ()) is False


@pytest.mark.parametrize(("connector", "message"), [
    ("{type: nixl, streaming: true}", "streaming needs connector type socket .*connector nixl"),
    ("{type: lmcache, streaming: false}", "streaming needs connector type socket .*connector lmcache"),
    ("{streaming: true}", "streaming needs connector type socket .*connector nixl"),   # type's default
    ("{type: socket, streaming: yes please}", "connector.streaming: expected true or false, got"),
    ("{type: socket, streaming: 1}", "connector.streaming: expected true or false, got"),
    ('{type: socket, streaming: "true"}', "connector.streaming: expected true or false, got"),
    ("{type: socket, stream: true}", "connector.stream: unknown field"),
])
def test_bad_streaming_is_refused_with_the_line(connector: str, message: str) -> None:
    with pytest.raises(TopologyError, match=r"topo.yaml:3: .*" + message):
        parse_topology(textwrap.dedent(TOPO).replace("connector: socket", f"connector: {connector}"), "topo.yaml")


def test_prefill_peer_is_one_instances_listener() -> None:
    topo = parse_topology(TWO_PREFILL, "topo.yaml", run_dir="/tmp/run")
    a, v6 = topo.role("prefill")
    assert prefill_peer(topo, a) == "198.18.0.1:5701"
    assert prefill_peer(topo, v6) == f"[fd00::7]:{v6.kv_port}"
