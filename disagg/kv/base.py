"""The KV-transfer adapter interface: what a connector needs from the engine, and what it can do.

One adapter per (engine, connector) pair. The engine adapter asks it, once per
instance while the deployment plan is built, for the connector's part of the
engine configuration. Adapters are pure: no I/O, no processes.

What a connector can do sits on its class, as vLLM puts it on its connector classes: the
proxy's handoff between its engines (:attr:`VllmKVAdapter.handoff_kind`,
:meth:`VllmKVAdapter.handoff_options`), whether a prefill engine serves a plain request alone
(:attr:`VllmKVAdapter.serves_whole`), and the secrets it needs drawn per run
(:attr:`VllmKVAdapter.run_secrets`). The vLLM engine adapter answers for its connector
(:class:`disagg.engines.base.EngineAdapter`); ``disagg.launch`` and ``disagg check`` ask it.
"""

from __future__ import annotations

import secrets
from abc import ABC, abstractmethod
from typing import Any, ClassVar

from disagg.serving import VLLM_HANDOFF
from disagg.topology import HostSpec, InstanceSpec, Topology


class VllmKVAdapter(ABC):
    """A KV connector as vLLM sees it: a ``--kv-transfer-config`` plus env."""

    #: the topology's ``connector:`` value
    name: str
    #: the proxy's handoff (``disagg proxy --handoff``) between engines with this connector
    handoff_kind: ClassVar[str] = VLLM_HANDOFF
    #: a prefill engine with this connector serves a plain request alone (the routing path
    #: ``whole``; tests/e2e/test_nixl_whole.py and test_socket_conformance.py prove it for theirs)
    serves_whole: ClassVar[bool] = False
    #: environment variables that carry a secret drawn fresh for every run: ``disagg up`` draws them
    #: (:meth:`run_env`) and hands them to every engine, never on a command line or in a plan
    run_secrets: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def transfer_config(self, topo: Topology, inst: InstanceSpec, host: HostSpec) -> dict[str, Any]:
        """The JSON object passed as ``--kv-transfer-config`` for this instance."""

    @abstractmethod
    def env(self, topo: Topology, inst: InstanceSpec, host: HostSpec) -> dict[str, str]:
        """Environment variables the connector needs in this instance."""

    def files(self, topo: Topology, inst: InstanceSpec, host: HostSpec) -> dict[str, str]:
        """Config files the instance needs: name in the run directory -> contents (default none)."""
        return {}

    def handoff(self, topo: Topology) -> str:
        """The proxy's handoff for this disaggregated topology (default :attr:`handoff_kind`)."""
        return self.handoff_kind

    def handoff_options(self, topo: Topology) -> tuple[tuple[str, str], ...]:
        """The proxy's ``--handoff-option`` settings for this disaggregated topology (default none)."""
        return ()

    def run_env(self, topo: Topology) -> dict[str, str]:
        """A fresh value of each of :attr:`run_secrets` (256 bits, hex), for one run's engines."""
        return {name: secrets.token_hex(32) for name in self.run_secrets}

    def settings_text(self, topo: Topology) -> str:
        """The connector's own settings for ``disagg check``'s mode line (default none)."""
        return ""


def kv_role(inst: InstanceSpec) -> str:
    """vLLM's kv_role for a disaggregated role."""
    return {"prefill": "kv_producer", "decode": "kv_consumer"}[inst.role]
