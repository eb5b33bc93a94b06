"""The KV-transfer adapter interface: what a connector needs from the engine.

One adapter per (engine, connector) pair. The engine adapter asks it, once per
instance while the deployment plan is built, for the connector's part of the
engine configuration. Adapters are pure: no I/O, no processes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from disagg.topology import HostSpec, InstanceSpec, Topology


class VllmKVAdapter(ABC):
    """A KV connector as vLLM sees it: a ``--kv-transfer-config`` plus env."""

    #: the topology's ``connector:`` value
    name: str

    @abstractmethod
    def transfer_config(self, topo: Topology, inst: InstanceSpec, host: HostSpec) -> dict[str, Any]:
        """The JSON object passed as ``--kv-transfer-config`` for this instance."""

    @abstractmethod
    def env(self, topo: Topology, inst: InstanceSpec, host: HostSpec) -> dict[str, str]:
        """Environment variables the connector needs in this instance."""

    def files(self, topo: Topology, inst: InstanceSpec, host: HostSpec) -> dict[str, str]:
        """Config files the instance needs: name in the run directory -> contents (default none)."""
        return {}


def kv_role(inst: InstanceSpec) -> str:
    """vLLM's kv_role for a disaggregated role."""
    return {"prefill": "kv_producer", "decode": "kv_consumer"}[inst.role]
