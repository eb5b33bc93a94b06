"""What a topology emulates on this machine: its link and its hosts' hardware.

Hosts: ``emulate: {prefill_rate, kv_memory, cpu_share}`` (``disagg.topology.EmulationSpec``);
the engine adapter turns the first two into an engine variable and flag, and
:func:`cpu_share_for` names the cgroup that holds a host's CPU quota, which the
launcher creates and ``down`` removes (:mod:`disagg.cpushare`).

The link (``link: {type: emulated, rate: ...}``):

The prefill host runs in a network namespace of its own behind a veth pair
shaped with tc tbf at the link's rate (both directions); the decode host and
the proxy stay in the root namespace, where clients can reach the proxy. The
namespace and interface names derive from the topology name, so ``check``
prints them, ``up`` creates them and ``down`` (another process) removes them.
"""

from __future__ import annotations

import hashlib
import re

from disagg.cpushare import CpuShare
from disagg.linkemu import EmulatedLink
from disagg.topology import HostSpec, Topology


def link_tag(topo: Topology) -> str:
    """A short stable tag (namespace and interface names) for this topology's link."""
    return "e" + hashlib.sha1(topo.name.encode()).hexdigest()[:8]


def prefill_host(topo: Topology) -> HostSpec:
    """The host that sits behind the shaped link (validated to be the only prefill host)."""
    return topo.hosts[topo.role("prefill")[0].host]


def decode_host(topo: Topology) -> HostSpec:
    return topo.hosts[topo.role("decode")[0].host]


def emulated_link(topo: Topology) -> EmulatedLink:
    """The (not yet opened) link object for an emulated topology."""
    assert topo.link.type == "emulated" and topo.link.rate_bps
    return EmulatedLink(topo.link.rate_bps, tag=link_tag(topo),
                        addresses=(prefill_host(topo).address, decode_host(topo).address), b_in_root=True)


def interface_for(topo: Topology, host: HostSpec) -> str | None:
    """The emulated link's interface on ``host`` (for UCX_NET_DEVICES), if it has one."""
    if topo.link.type != "emulated":
        return None
    link = emulated_link(topo)
    if host.name == prefill_host(topo).name:
        return link.a.interface
    if host.name == decode_host(topo).name:
        return link.b.interface
    return None


def cpu_share_for(topo: Topology, host: HostSpec) -> CpuShare | None:
    """The cgroup that holds ``host``'s CPU quota (``emulate.cpu_share``), or None.

    Named after the topology (like the link's namespace) and the host, so ``check`` prints it
    and a later ``up`` finds one a killed run left behind."""
    if host.emulate is None or host.emulate.cpu_share is None:
        return None
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", host.name)[:40]
    return CpuShare(f"disagg-{link_tag(topo)}-{safe}", host.emulate.cpu_share)


def emulation_lines(topo: Topology) -> list[str]:
    """One line per host that emulates hardware: what ``check``, ``up`` and ``bench`` print."""
    lines = []
    for host in topo.hosts.values():
        if host.emulate is None:
            continue
        share = cpu_share_for(topo, host)
        lines.append(f"{host.name}: {host.emulate.describe()}" + (f" in cgroup {share.name}" if share else ""))
    return lines
