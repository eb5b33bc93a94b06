"""UCX transport selection for connectors that move KV over UCX (NIXL)."""

from __future__ import annotations

from disagg.emulation import interface_for
from disagg.topology import HostSpec, Topology

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
    ``UCX_NET_DEVICES``: the emulated link's interface on this host, else the topology's
    ``link.interface`` (unset: UCX's own choice)."""
    env = {}
    tls = ucx_tls(topo, host)
    if tls:
        env["UCX_TLS"] = tls
    device = interface_for(topo, host) or topo.link.interface
    if device:
        env["UCX_NET_DEVICES"] = device
    return env
