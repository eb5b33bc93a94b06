"""Stock SGLang (``python -m sglang.launch_server``) as an engine.

Flag names are SGLang's own (checked against sglang 0.5.23's
``srt/arg_groups/fields/*.py`` and its ServerArgs CLI parser; see
``scripts/check_engine_configs.py``).

Connector -> ``--disaggregation-transfer-backend``:

- ``connector: mooncake`` -> ``mooncake``. On links without RDMA (loopback,
  ethernet, emulated) the env ``MC_FORCE_TCP=1`` makes Mooncake use its TCP
  transport; SGLang compares the value with ``"1"`` exactly
  (``mooncake_transfer_engine.py``), so ``true`` would not do. On ``roce``
  links ``--disaggregation-ib-device`` names the link's ``interface`` (an HCA
  such as ``mlx5_0``).
- ``connector: nixl`` -> ``nixl`` (UCX). TCP-only links pin ``UCX_TLS`` to
  TCP as for vLLM; on ``roce`` the HCA goes to ``--disaggregation-ib-device``.
- ``lmcache`` and ``socket`` are vLLM connectors: a :class:`DeploymentError`.

Engine key: SGLang engines are not guarded. SGLang's ``--api-key`` would
guard every route but ``/health*`` and ``/metrics*``, but it is read only from
the command line (no environment variable), where ``ps`` shows it to every
user of the host; so no key is passed and the proxy's key (if any) is ignored.
Keep SGLang engines on addresses only the proxy can reach.

Each prefill instance's bootstrap server listens on its ``kv_port``
(``--disaggregation-bootstrap-port``); the proxy sends that port with every
request (``bootstrap_port``), so decode instances need none.
"""

from __future__ import annotations

from disagg.engines.base import EngineAdapter
from disagg.engines.vllm import served_model_name
from disagg.errors import DeploymentError
from disagg.kv.ucx import ucx_env, ucx_port_env
from disagg.serving import SGLANG_HANDOFF
from disagg.topology import HostSpec, InstanceSpec, Topology

LAUNCH_MODULE = "sglang.launch_server"
#: topology connector -> SGLang transfer backend
TRANSFER_BACKENDS = {"mooncake": "mooncake", "nixl": "nixl"}
#: links where Mooncake must use TCP (no RDMA device between the hosts)
TCP_LINKS = ("loopback", "ethernet", "emulated")


def transfer_backend(topo: Topology) -> str:
    """The ``--disaggregation-transfer-backend`` for the topology's connector."""
    try:
        return TRANSFER_BACKENDS[topo.connector]
    except KeyError:
        raise DeploymentError(f"{topo.located('connector')}: connector {topo.connector!r} does not work with "
                              "engine sglang; "
                        f"use one of {', '.join(TRANSFER_BACKENDS)}") from None


class SglangEngine(EngineAdapter):
    """``python -m sglang.launch_server`` per role instance (role ``both``: a plain server)."""

    name = "sglang"
    health_path = "/health"
    #: a decode server needs a prefill server's KV: every route goes through the handoff
    decode_prefills = False

    def handoff(self, topo: Topology) -> str:
        return SGLANG_HANDOFF

    def handoff_options(self, topo: Topology) -> tuple[tuple[str, str], ...]:
        """``bootstrap_ports``: each prefill instance's bootstrap port, in ``--prefill`` order."""
        return (("bootstrap_ports", ",".join(str(inst.kv_port) for inst in topo.role("prefill"))),)

    def key_env(self, topo: Topology) -> str | None:
        """None: SGLang takes a key only as ``--api-key`` on its command line (see the module docstring)."""
        return None

    def argv(self, topo: Topology, inst: InstanceSpec, host: HostSpec, python: str) -> list[str]:
        model = topo.model
        argv = [python, "-m", LAUNCH_MODULE,
                "--model-path", topo.model_path(host),
                "--served-model-name", served_model_name(topo),
                "--host", host.address,
                "--port", str(inst.port),
                "--enable-metrics"]
        if model.dtype != "auto":
            argv += ["--dtype", model.dtype]
        if model.max_model_len:
            argv += ["--context-length", str(model.max_model_len)]
        if host.device == "cpu":
            argv += ["--device", "cpu"]
        elif len(inst.gpus) > 1:
            argv += ["--tp-size", str(len(inst.gpus))]
        if inst.role != "both":
            argv += ["--disaggregation-mode", inst.role,
                     "--disaggregation-transfer-backend", transfer_backend(topo)]
            if inst.role == "prefill":
                if inst.kv_port is None:  # the topology assigns one to every prefill instance
                    raise DeploymentError(f"{topo.file}: {inst.name} has no kv_port for its bootstrap server")
                argv += ["--disaggregation-bootstrap-port", str(inst.kv_port)]
            if topo.link.type == "roce" and topo.link.interface:
                argv += ["--disaggregation-ib-device", topo.link.interface]
        argv += list(inst.args)
        return argv

    def env(self, topo: Topology, inst: InstanceSpec, host: HostSpec) -> dict[str, str]:
        env: dict[str, str] = {}
        if host.device != "cpu" and inst.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in inst.gpus)
        if inst.role != "both":
            backend = transfer_backend(topo)
            if backend == "mooncake" and topo.link.type in TCP_LINKS:
                env["MC_FORCE_TCP"] = "1"
            if backend == "nixl":
                env.update(ucx_env(topo, host))
                env.update(ucx_port_env(topo, inst))
        env.update(dict(inst.env))
        return env
