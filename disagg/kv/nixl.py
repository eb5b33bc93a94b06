"""NIXL (UCX) as vLLM's KV connector, in vLLM's two modes.

- ``connector: nixl``, :class:`NixlVllmAdapter`: ``NixlConnector`` (pull mode): P keeps a
  finished request's blocks, D READs them after the proxy handed it P's reply.
- ``connector: nixl-push``, :class:`NixlPushVllmAdapter`: ``NixlPushConnector`` (vLLM 0.32's
  push mode): D allocates blocks for a request and registers them with P (a NIXL
  notification naming P's engine id and side channel), P WRITEs its KV into them when its
  prefill finishes. The proxy sends both requests at once
  (:mod:`disagg.proxy.nixl_push_handoff`).

Both modes get the same engine settings (roles, buffer device, side channel, UCX
transports, one NIXL thread on CPU hosts and a progress thread that waits for UCX events there
instead of spinning); the vLLM engine adapter
(:class:`disagg.engines.vllm.VllmEngine`) asks for them per instance while the plan is built.
"""

from __future__ import annotations

from typing import Any, ClassVar

from disagg_connectors.nixl_cpu_affinity import ENABLED as NIXL_CPU_AFFINITY_OWN_CORES
from disagg_connectors.nixl_cpu_affinity import ENV as NIXL_CPU_AFFINITY_ENV
from disagg_connectors.nixl_progress_wait import CPU_WAIT_US as NIXL_CPU_PROGRESS_WAIT_US
from disagg_connectors.nixl_progress_wait import ENV as NIXL_PROGRESS_WAIT_ENV

from disagg.kv.base import VllmKVAdapter, kv_role
from disagg.kv.ucx import ucx_env, ucx_port_env
from disagg.serving import NIXL_PUSH_HANDOFF
from disagg.topology import HostSpec, InstanceSpec, Topology


class NixlVllmAdapter(VllmKVAdapter):
    """vLLM NixlConnector configuration (pull mode)."""

    name = "nixl"
    #: vLLM's connector class (``kv_connector``)
    connector_class: ClassVar[str] = "NixlConnector"
    serves_whole = True

    def transfer_config(self, topo: Topology, inst: InstanceSpec, host: HostSpec) -> dict[str, Any]:
        extra: dict[str, Any] = {"backends": ["UCX"]}
        if host.device == "cpu":
            # One NIXL progress thread per engine: on small CPU hosts more
            # threads busy-spin against the engine (measured on 2 cores: a
            # handoff took 37-58 s with more threads unpinned, 0.4 s with one).
            extra["num_threads"] = 1
        return {
            "kv_connector": self.connector_class,
            "kv_role": kv_role(inst),
            "kv_buffer_device": "cuda" if host.device == "cuda" else "cpu",
            "kv_connector_extra_config": extra,
        }

    def env(self, topo: Topology, inst: InstanceSpec, host: HostSpec) -> dict[str, str]:
        env = {
            # The address the peer connects to for the NIXL handshake.
            "VLLM_NIXL_SIDE_CHANNEL_HOST": host.address,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(inst.kv_port),
        }
        env.update(ucx_env(topo, host))  # GPU buffers also need cuda_copy over TCP
        env.update(ucx_port_env(topo, inst))  # UCX's listener within a known range (firewalls)
        if host.device == "cpu":
            # NIXL's progress thread would spin on the engine's core; it waits for UCX
            # events instead (connectors/nixl_progress_wait.py, a vLLM general plugin).
            env[NIXL_PROGRESS_WAIT_ENV] = NIXL_CPU_PROGRESS_WAIT_US
            if inst.cpus:
                # vLLM's NIXL worker moves its compute thread to the machine's last core
                # unless told otherwise; keep it on the engine's own cores
                # (connectors/nixl_cpu_affinity.py, a vLLM general plugin).
                env[NIXL_CPU_AFFINITY_ENV] = NIXL_CPU_AFFINITY_OWN_CORES
        return env


class NixlPushVllmAdapter(NixlVllmAdapter):
    """vLLM NixlPushConnector configuration (push mode: P WRITEs into blocks D registered).

    Both sides handshake over the side channel: D with P (to send its registration), P with
    D (to WRITE), so every instance gets ``VLLM_NIXL_SIDE_CHANNEL_HOST/PORT`` as in pull mode.
    No engine id is set: vLLM draws a fresh one per start, which P reports in every reply
    (``kv_transfer_params.remote_engine_id``) and the proxy learns from there. A fixed id
    would survive a restart, and vLLM 0.32's push mode keeps a replaced peer's old NIXL
    agent under its id (``_track_remote_engine_replacement``: "TODO: Also handle push
    mode"), so D would register with a process that is gone and wait for ever.

    Decode instances get ``kv_load_failure_policy: recompute``: a registration D cannot
    deliver (P unreachable, or an engine id P no longer has) makes D prefill the prompt
    itself instead of failing the request.
    """

    name = "nixl-push"
    connector_class: ClassVar[str] = "NixlPushConnector"
    handoff_kind = NIXL_PUSH_HANDOFF
    serves_whole = False

    def transfer_config(self, topo: Topology, inst: InstanceSpec, host: HostSpec) -> dict[str, Any]:
        config = super().transfer_config(topo, inst, host)
        if inst.role == "decode":
            config["kv_load_failure_policy"] = "recompute"
        return config
