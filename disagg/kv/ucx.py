"""UCX transport selection for connectors that move KV over UCX (NIXL)."""

from __future__ import annotations

from disagg.emulation import interface_for
from disagg.topology import HostSpec, InstanceSpec, Topology

#: UCX's TCP transport listens on a random port of this range (UCX_TCP_PORT_RANGE, "LO-HI"; UCX retries
#: another port of the range while one is busy, and keeps only the part inside the host's
#: net.ipv4.ip_local_port_range)
UCX_PORT_RANGE_ENV = "UCX_TCP_PORT_RANGE"
#: the default range of an engine: UCX_PORT_BASE + (kv_port mod 1000) x UCX_PORTS_PER_ENGINE, so
#: engines whose kv_ports differ in the last three digits never share a port, and every range lies
#: in Linux's default local port range (32768-60999)
UCX_PORT_BASE = 40000
UCX_PORTS_PER_ENGINE = 16

# UCX transports per link type. RoCE is left to UCX's own choice (it prefers
# RDMA); every TCP-only link is pinned to tcp so UCX never probes devices the
# hosts do not share.
UCX_TLS_BY_LINK = {
    "loopback": "tcp,self",
    "ethernet": "tcp,self",
    "emulated": "tcp,self",
}

#: extra transports when the KV buffers live in GPU memory: staging copies,
#: and CUDA IPC between GPUs of one machine (LMCache's own examples use both)
CUDA_TLS = {"loopback": "cuda_ipc,cuda_copy", "ethernet": "cuda_copy", "emulated": "cuda_copy"}


def ucx_tls(topo: Topology, host: HostSpec) -> str | None:
    """``UCX_TLS`` for this host on the topology's link (None: leave UCX's own choice, e.g. RoCE)."""
    tls = UCX_TLS_BY_LINK.get(topo.link.type)
    if tls is None:
        return None
    if host.device == "cuda":
        return f"{CUDA_TLS[topo.link.type]},{tls}"
    return tls


def ucx_env(topo: Topology, host: HostSpec) -> dict[str, str]:
    """The UCX environment of an engine on ``host``, for every connector that moves KV over UCX
    (NIXL in vLLM and SGLang, LMCache's NIXL channel): ``UCX_TLS`` as :func:`ucx_tls` says, and
    ``UCX_NET_DEVICES``: the emulated link's interface on this host, else the host's ``interface``,
    else the topology's ``link.interface`` (unset: UCX's own choice)."""
    env = {}
    tls = ucx_tls(topo, host)
    if tls:
        env["UCX_TLS"] = tls
    device = interface_for(topo, host) or host.interface or topo.link.interface
    if device:
        env["UCX_NET_DEVICES"] = device
    return env


def ucx_port_range(topo: Topology, inst: InstanceSpec) -> tuple[int, int] | None:
    """The TCP ports an engine's UCX listens on: ``link.ucx_ports``, else its own 16 ports derived from
    its ``kv_port`` (:data:`UCX_PORT_BASE`); None for an engine without a kv_port (colocated).
    The NIXL adapters put it in ``UCX_TCP_PORT_RANGE``; ``disagg doctor`` checks the ports."""
    if topo.link.ucx_ports is not None:
        return topo.link.ucx_ports
    if inst.kv_port is None:
        return None
    low = UCX_PORT_BASE + (inst.kv_port % 1000) * UCX_PORTS_PER_ENGINE
    return low, low + UCX_PORTS_PER_ENGINE - 1


def ucx_port_env(topo: Topology, inst: InstanceSpec) -> dict[str, str]:
    """``{UCX_TCP_PORT_RANGE: "LO-HI"}`` for an engine that moves KV over UCX (empty without a range)."""
    ports = ucx_port_range(topo, inst)
    return {UCX_PORT_RANGE_ENV: f"{ports[0]}-{ports[1]}"} if ports else {}
