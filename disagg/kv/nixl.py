"""NIXL (UCX) as vLLM's KV connector: pull mode, P keeps blocks, D reads them."""

from __future__ import annotations

from typing import Any

from disagg_connectors.nixl_cpu_affinity import ENABLED as NIXL_CPU_AFFINITY_OWN_CORES
from disagg_connectors.nixl_cpu_affinity import ENV as NIXL_CPU_AFFINITY_ENV

from disagg.kv.base import VllmKVAdapter, kv_role
from disagg.kv.ucx import ucx_env
from disagg.topology import HostSpec, InstanceSpec, Topology


class NixlVllmAdapter(VllmKVAdapter):
    """vLLM NixlConnector configuration."""

    name = "nixl"

    def transfer_config(self, topo: Topology, inst: InstanceSpec, host: HostSpec) -> dict[str, Any]:
        extra: dict[str, Any] = {"backends": ["UCX"]}
        if host.device == "cpu":
            # One NIXL progress thread per engine: on small CPU hosts more
            # threads busy-spin against the engine (measured on 2 cores: a
            # handoff took 37-58 s with more threads unpinned, 0.4 s with one).
            extra["num_threads"] = 1
        return {
            "kv_connector": "NixlConnector",
            "kv_role": kv_role(inst),
            "kv_buffer_device": "cuda" if host.device == "cuda" else "cpu",
            "kv_connector_extra_config": extra,
        }

    def env(self, topo: Topology, inst: InstanceSpec, host: HostSpec) -> dict[str, str]:
        env = {
            # The address the decode host connects to for the NIXL handshake.
            "VLLM_NIXL_SIDE_CHANNEL_HOST": host.address,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(inst.kv_port),
        }
        env.update(ucx_env(topo, host))  # GPU buffers also need cuda_copy over TCP
        if host.device == "cpu" and inst.cpus:
            # vLLM's NIXL worker moves its compute thread to the machine's last core
            # unless told otherwise; keep it on the engine's own cores
            # (connectors/nixl_cpu_affinity.py, a vLLM general plugin).
            env[NIXL_CPU_AFFINITY_ENV] = NIXL_CPU_AFFINITY_OWN_CORES
        return env
