"""The NIXL plan: per-host environment (side channel, UCX, the CPU core guard)."""

from __future__ import annotations

import textwrap

from disagg.deployment import build_deployment
from disagg.topology import parse_topology

TEXT = """\
model: {path: /models/m}
engine: vllm
connector: nixl
hosts:
  p: {address: 127.0.0.1, device: DEVICE}
  d: {address: 127.0.0.1, device: cpu}
roles:
  prefill: [{host: p, port: 8100, kv_port: 5601, PLACEMENT}]
  decode: [{host: d, port: 8200, kv_port: 5602}]
"""


def env_of(device: str, placement: str, role: str = "prefill") -> dict[str, str]:
    text = textwrap.dedent(TEXT).replace("DEVICE", device).replace("PLACEMENT", placement)
    dep = build_deployment(parse_topology(text, "t.yaml", run_dir="/tmp/run"))
    return dict(dep.role(role)[0].env)


def test_pinned_cpu_engine_keeps_nixl_on_its_own_cores() -> None:
    env = env_of("cpu", "cpus: [0]")
    assert env["DISAGG_NIXL_CPU_AFFINITY"] == "own-cores"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5601"


def test_unpinned_and_gpu_engines_are_left_to_vllm() -> None:
    assert "DISAGG_NIXL_CPU_AFFINITY" not in env_of("cpu", "args: []", role="decode")
    assert "DISAGG_NIXL_CPU_AFFINITY" not in env_of("cuda", "gpus: [0]")


def test_cpu_engines_wait_for_ucx_events_and_gpu_engines_are_left_to_nixl() -> None:
    for env in (env_of("cpu", "cpus: [0]"), env_of("cpu", "args: []", role="decode")):
        assert env["DISAGG_NIXL_PROGRESS_WAIT_US"] == "1000"
    assert "DISAGG_NIXL_PROGRESS_WAIT_US" not in env_of("cuda", "gpus: [0]")


def plan_of(connector: str, device: str = "cpu") -> dict[str, tuple[dict[str, object], dict[str, str]]]:
    """Each role's --kv-transfer-config and environment for ``connector``."""
    import json

    text = textwrap.dedent(TEXT).replace("DEVICE", device).replace("PLACEMENT", "cpus: [0]")
    text = text.replace("connector: nixl", f"connector: {connector}")
    dep = build_deployment(parse_topology(text, "t.yaml", run_dir="/tmp/run"))
    out = {}
    for role in ("prefill", "decode"):
        eng = dep.role(role)[0]
        config = json.loads(eng.argv[eng.argv.index("--kv-transfer-config") + 1])
        out[role] = (config, dict(eng.env))
    return out


def test_push_mode_is_nixl_with_vllms_push_connector_and_decode_recomputing() -> None:
    pull, push = plan_of("nixl"), plan_of("nixl-push")
    for role in ("prefill", "decode"):
        pull_config, pull_env = pull[role]
        push_config, push_env = push[role]
        assert pull_config["kv_connector"] == "NixlConnector" and push_config["kv_connector"] == "NixlPushConnector"
        extra = {"kv_load_failure_policy": "recompute"} if role == "decode" else {}
        assert push_config == {**pull_config, "kv_connector": "NixlPushConnector", **extra}
        assert push_env == pull_env                      # side channel, UCX, the CPU core guard: as in pull mode
    assert push["prefill"][0]["kv_role"] == "kv_producer" and push["decode"][0]["kv_role"] == "kv_consumer"
    assert push["prefill"][1]["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5601"
    assert push["decode"][1]["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5602"
    # no engine id: vLLM draws one per start, which the proxy learns from prefill's replies
    assert all("engine_id" not in config for config, _ in push.values())


def test_push_mode_on_cuda_hosts_buffers_on_the_gpu() -> None:
    config, env = plan_of("nixl-push", device="cuda")["prefill"]
    assert config["kv_buffer_device"] == "cuda" and "num_threads" not in config["kv_connector_extra_config"]
    assert "cuda_copy" in env["UCX_TLS"].split(",")        # UCX stages GPU buffers
