"""Our TCP KV connector (``connectors/socket_connector``) as vLLM's KV connector.

Pull mode like NIXL: the prefill engine keeps a finished request's blocks
under a lease and listens on ``host.address:kv_port``; the decode engine
fetches them over authenticated TCP. Both engines need the same shared secret
in ``DISAGG_KV_SECRET``: ``disagg up`` generates one per topology
(``generate_secret()``) and puts it in its own environment before planning,
so the plan carries it to every engine's env (never into argv, which vLLM
and ``ps`` show).
"""

from __future__ import annotations

import os
import secrets
from typing import Any

from disagg.errors import PlanError
from disagg.kv.base import VllmKVAdapter, kv_role
from disagg.topology import HostSpec, InstanceSpec, Topology

#: Env var holding the shared secret, at plan time and in the engines.
SECRET_ENV = "DISAGG_KV_SECRET"
#: The importable module vLLM loads the connector class from.
CONNECTOR_MODULE = "disagg_connectors.socket_connector"
CONNECTOR_CLASS = "SocketKVConnector"


def generate_secret() -> str:
    """A fresh per-topology secret (256 bits, hex) for ``SECRET_ENV``."""
    return secrets.token_hex(32)


class SocketVllmAdapter(VllmKVAdapter):
    """vLLM ``SocketKVConnector`` configuration: listener on the host's link address."""

    name = "socket"

    def transfer_config(self, topo: Topology, inst: InstanceSpec, host: HostSpec) -> dict[str, Any]:
        extra: dict[str, Any] = {"secret_env": SECRET_ENV}
        config: dict[str, Any] = {
            "kv_connector": CONNECTOR_CLASS,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": kv_role(inst),
            "kv_connector_extra_config": extra,
        }
        if inst.role == "prefill":
            if inst.kv_port is None:
                raise PlanError(f"{inst.name} (line {inst.line}): the socket connector needs a kv_port")
            extra.update(host=host.address, port=inst.kv_port)
        else:
            # A failed fetch makes the decode engine prefill locally instead of
            # failing the request.
            config["kv_load_failure_policy"] = "recompute"
        return config

    def env(self, topo: Topology, inst: InstanceSpec, host: HostSpec) -> dict[str, str]:
        secret = os.environ.get(SECRET_ENV, "")
        if not secret:
            raise PlanError(
                f"connector socket needs a shared secret in env {SECRET_ENV} when planning "
                "(`disagg up` generates one per topology)"
            )
        return {SECRET_ENV: secret}
