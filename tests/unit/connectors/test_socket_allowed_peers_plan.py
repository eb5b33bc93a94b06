"""``allowed_peers`` as ``disagg`` plans it for prefill instances (disagg/kv/socket.py): the addresses
the decode engines' connections come from, in a form the connector's own settings accept."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from disagg_connectors.socket_connector.config import SocketSettings

from disagg.deployment import build_deployment
from disagg.kv.socket import SECRET_ENV
from disagg.topology import load_topology, parse_topology

REPO = Path(__file__).resolve().parents[3]

TOPO = """\
model: {path: disagg:tiny, max_model_len: 2048}
engine: vllm
connector: socket
link: {type: ethernet, rate: 2.5gbit}
hosts:
  a: {address: PREFILL}
  b: {address: DECODE}
  c: {address: OTHER_DECODE}
roles:
  prefill:
    - {host: a, port: 8100, kv_port: 5701}
  decode:
    - {host: b, port: 8200}
    - {host: c, port: 8201}
    - {host: b, port: 8202}
"""


def extra_configs(text: str) -> dict[str, dict]:
    """Each engine's kv_connector_extra_config, by instance name."""
    topo = parse_topology(text, "topo.yaml", run_dir="/tmp/run")
    out = {}
    for launch in build_deployment(topo).engines:
        argv = list(launch.argv)
        out[launch.instance.name] = json.loads(argv[argv.index("--kv-transfer-config") + 1])[
            "kv_connector_extra_config"]
    return out


def topology(prefill: str, decode: str, other_decode: str) -> str:
    return TOPO.replace("PREFILL", prefill).replace("OTHER_DECODE", other_decode).replace("DECODE", decode)


def prefill_extra(configs: dict[str, dict]) -> dict:
    (extra,) = [e for name, e in configs.items() if name.startswith("prefill")]
    return extra


@pytest.mark.parametrize(("prefill", "decode", "other", "expected"), [
    ("198.18.0.1", "198.18.0.2", "198.18.0.3", ["198.18.0.2", "198.18.0.3"]),
    ('"fd00::1"', '"fd00::2"', '"fd00::2"', ["fd00::2"]),
    ("10.0.0.1", "10.0.0.2", "10.0.0.2", ["10.0.0.2"]),
])
def test_a_prefill_listener_accepts_the_decode_hosts_addresses(prefill: str, decode: str, other: str,
                                                               expected: list[str]) -> None:
    configs = extra_configs(topology(prefill, decode, other))
    extra = prefill_extra(configs)
    assert extra["allowed_peers"] == expected
    settings = SocketSettings.load(extra, {SECRET_ENV: "5e" * 32}, need_port=True)
    assert settings.allowed_peers == tuple(expected)
    assert all("allowed_peers" not in e for name, e in configs.items() if name.startswith("decode"))


@pytest.mark.parametrize(("prefill", "decode", "other"), [
    ("198.18.0.1", "decode-box.lan", "198.18.0.3"),       # a host name: where it dials from is not known
    ("198.18.0.1", "127.0.0.1", "127.0.0.1"),             # loopback decode, remote listener: its LAN address
    ("prefill-box.lan", "198.18.0.2", "198.18.0.3"),
    ('"fd00::1"', "198.18.0.2", "198.18.0.2"),            # another IP version than the listener's
])
def test_allowed_peers_stays_off_when_the_sources_are_not_known(prefill: str, decode: str, other: str) -> None:
    extra = prefill_extra(extra_configs(topology(prefill, decode, other)))
    assert "allowed_peers" not in extra
    assert SocketSettings.load(extra, {SECRET_ENV: "5e" * 32}, need_port=True).allowed_peers == ()


@pytest.mark.parametrize(("name", "expected"), [
    ("local-cpu.yaml", ["127.0.0.1"]),
])
def test_the_shipped_socket_topologies(name: str, expected: list[str]) -> None:
    topo = load_topology(REPO / "topologies" / name, run_dir="/tmp/run")
    (launch,) = [e for e in build_deployment(topo).engines if e.instance.role == "prefill"]
    argv = list(launch.argv)
    extra = json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert extra["allowed_peers"] == expected


def test_loopback_hosts_also_allow_the_loopback_routes_source() -> None:
    """A connection to any 127.0.0.0/8 address leaves from 127.0.0.1 (Linux's loopback route)."""
    text = textwrap.dedent("""\
        model: {path: disagg:tiny, max_model_len: 2048}
        engine: vllm
        connector: socket
        link: {type: loopback}
        hosts:
          p: {address: 127.0.0.1}
          d: {address: 127.0.0.2}
        roles:
          prefill:
            - {host: p, port: 8100, kv_port: 5701}
          decode:
            - {host: d, port: 8200}
        """)
    assert prefill_extra(extra_configs(text))["allowed_peers"] == ["127.0.0.2", "127.0.0.1"]


def test_an_emulated_link_allows_the_decode_side_of_its_slash_30() -> None:
    text = (REPO / "topologies" / "local-emulated-1g.yaml").read_text().replace("connector: nixl", "connector: socket")
    assert "connector: socket" in text
    assert prefill_extra(extra_configs(text))["allowed_peers"] == ["198.18.10.2"]
