"""`connector: socket` planning: kv-transfer-config and env for both roles."""

from __future__ import annotations

import json
import textwrap

from disagg.deployment import plan_deployment
from disagg.kv.socket import SECRET_ENV, generate_secret
from disagg.registry import vllm_kv_adapter
from disagg.topology import parse_topology

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
    return {e.instance.role: e for e in plan_deployment(topo).engines}


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
        "kv_connector_extra_config": {"secret_env": SECRET_ENV, "host": "198.18.0.1", "port": 5701},
    }
    assert SECRET_ENV not in dict(engines["prefill"].env)  # per run: added by the launcher, never planned


def test_decode_recomputes_on_failed_fetch() -> None:
    engines = plan()
    cfg = kv_config(engines["decode"])
    assert cfg["kv_role"] == "kv_consumer" and cfg["kv_load_failure_policy"] == "recompute"
    assert "port" not in cfg["kv_connector_extra_config"]



def test_generated_secrets_are_long_and_fresh() -> None:
    a, b = generate_secret(), generate_secret()
    assert a != b and len(a) == 64
