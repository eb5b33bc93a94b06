"""Our TCP KV connector (``connectors/socket_connector``) as vLLM's KV connector.

Pull mode like NIXL: the prefill engine keeps a finished request's blocks
under a lease and listens on ``host.address:kv_port``; the decode engine
fetches them over authenticated TCP. Both engines need the same shared secret
in ``DISAGG_KV_SECRET``: ``disagg up`` generates one per run
(``SocketVllmAdapter.run_secrets``) and adds it to every engine's environment when it
starts them (never to argv, which vLLM and ``ps`` show); the plan that
``disagg check`` prints names the variable, not a value.

Decode instances get ``peers``: every prefill instance's ``address:kv_port``
(TP rank r's listener is kv_port + r, which the connector derives from the
same entry). A decode engine fetches only from those, so a request naming
another host is computed locally instead of making it dial that host.

Prefill instances get ``allowed_peers``: the addresses the decode engines'
connections come from (:func:`decode_sources`), so that the listener closes
anyone else's at accept, before any handshake. Left out when a decode host's
address is a host name: where its connections come from is not known.

With ``connector: {type: socket, streaming: true}`` the proxy sends prefill and
decode their requests at once, joined by a per-request key
(:mod:`disagg.proxy.socket_stream_handoff`), and needs each prefill instance's
listener in ``--prefill`` order: :func:`prefill_peer` formats it for both.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from disagg.errors import DeploymentError
from disagg.kv.base import VllmKVAdapter, kv_role
from disagg.serving import KV_PEERS, STREAMING_HANDOFF
from disagg.topology import HostSpec, InstanceSpec, Topology

#: Env var holding the shared secret, at plan time and in the engines.
SECRET_ENV = "DISAGG_KV_SECRET"
#: The importable module vLLM loads the connector class from.
CONNECTOR_MODULE = "disagg_connectors.socket_connector"
CONNECTOR_CLASS = "SocketKVConnector"


def format_peer(address: str, port: int) -> str:
    """``address:port``, IPv6 literals bracketed (the connector's ``peers`` syntax)."""
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def prefill_peer(topo: Topology, inst: InstanceSpec) -> str:
    """A prefill instance's KV listener (TP rank 0's), ``address:kv_port``."""
    if inst.kv_port is None:
        raise DeploymentError(f"{inst.name} (line {inst.line}): the socket connector needs a kv_port")
    return format_peer(topo.host_of(inst).address, inst.kv_port)


def prefill_peers(topo: Topology) -> list[str]:
    """Every prefill listener of the topology, as the decode engines' ``peers`` setting."""
    peers = []
    for inst in topo.role("prefill"):
        peer = prefill_peer(topo, inst)
        if peer not in peers:
            peers.append(peer)
    return peers


def decode_sources(topo: Topology, listener: HostSpec) -> list[str] | None:
    """The source addresses of the decode engines' connections to a prefill KV listener on
    ``listener``'s address, as that prefill instance's ``allowed_peers``; None when they are not
    known: an address (the listener's or a decode host's) that is a host name, or a decode host
    whose address is of the other IP version than the listener's, or loopback where the
    listener's is not (or the reverse: the connection's source is then another address of that
    host, picked by its routes).

    Each decode host's own address, and for a loopback one also ``127.0.0.1``: Linux gives a
    connection to any 127.0.0.0/8 address the source 127.0.0.1 (the loopback route's ``src``)."""
    try:
        listening = ipaddress.ip_address(listener.address)
    except ValueError:
        return None
    sources: list[str] = []
    for inst in topo.role("decode"):
        try:
            ip = ipaddress.ip_address(topo.host_of(inst).address)
        except ValueError:
            return None
        if ip.version != listening.version or ip.is_loopback != listening.is_loopback:
            return None
        found = [str(ip)]
        if ip.version == 4 and ip.is_loopback:
            found.append("127.0.0.1")
        sources.extend(a for a in found if a not in sources)
    return sources or None


class SocketVllmAdapter(VllmKVAdapter):
    """vLLM ``SocketKVConnector`` configuration: listener on the host's link address."""

    name = "socket"
    serves_whole = True
    run_secrets = (SECRET_ENV,)

    def transfer_config(self, topo: Topology, inst: InstanceSpec, host: HostSpec) -> dict[str, Any]:
        extra: dict[str, Any] = {"secret_env": SECRET_ENV}
        if topo.wire_format != "raw":
            cache = inst.arg("--kv-cache-dtype") or "auto"
            if cache.startswith("fp8"):
                raise DeploymentError(f"{inst.name} (line {inst.line}): connector.wire_format {topo.wire_format} "
                                      f"needs a 16- or 32-bit KV cache, not --kv-cache-dtype {cache}")
            extra["wire_format"] = topo.wire_format
        config: dict[str, Any] = {
            "kv_connector": CONNECTOR_CLASS,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": kv_role(inst),
            "kv_connector_extra_config": extra,
        }
        if inst.role == "prefill":
            if inst.kv_port is None:
                raise DeploymentError(f"{inst.name} (line {inst.line}): the socket connector needs a kv_port")
            extra.update(host=host.address, port=inst.kv_port)
            allowed = decode_sources(topo, host)
            if allowed is not None:
                extra["allowed_peers"] = allowed
        else:
            # A failed fetch makes the decode engine prefill locally instead of
            # failing the request.
            config["kv_load_failure_policy"] = "recompute"
            extra["peers"] = prefill_peers(topo)
        return config

    def env(self, topo: Topology, inst: InstanceSpec, host: HostSpec) -> dict[str, str]:
        # The secret is per run: the launcher adds SECRET_ENV (run_secrets) when it starts the engines.
        return {}

    def handoff(self, topo: Topology) -> str:
        """The streaming handoff with ``connector.streaming``, else vLLM's."""
        return STREAMING_HANDOFF if topo.streaming else self.handoff_kind

    def handoff_options(self, topo: Topology) -> tuple[tuple[str, str], ...]:
        """Streaming: each prefill instance's KV listener, in the order of the proxy's ``--prefill`` URLs."""
        if not topo.streaming:
            return ()
        return ((KV_PEERS, ",".join(prefill_peer(topo, inst) for inst in topo.role("prefill"))),)

    def settings_text(self, topo: Topology) -> str:
        streaming = "on: decode receives the KV while prefill computes" if topo.streaming else "off"
        return f"wire_format {topo.wire_format}, streaming {streaming}"
