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
