"""What a valid topology file may still get wrong: facts of the machine that runs it, and settings
that are legal but probably not meant. Each finding names ``file:line: field``.

Two passes over a :class:`~disagg.topology.Topology` (its own validation is in
``disagg.topology``, which refuses what is wrong whatever the machine):

- :func:`host_findings`, this machine's facts, for the hosts without ``ssh`` (a remote host's
  facts are ``doctor``'s): an address this machine does not have (hosts of an ``emulated``
  link are exempt: ``up`` creates their addresses), ``cpus`` beyond the cores this process may
  use, a model path that does not exist. ``disagg check`` prints them as warnings (a file may be
  meant for another machine; ``check --here`` makes them errors); ``disagg up`` refuses them
  (:func:`require_runnable_here`).
- :func:`advisories`, warnings wherever the file is read: two engines on one GPU whose
  ``--gpu-memory-utilization`` add up to more than the GPU, a proxy on every address without
  ``api_key``, an ``ssh`` host at a loopback address.

Called by ``disagg.commands.basic`` (check) and ``disagg.commands.lifecycle`` (up).
"""

from __future__ import annotations

import ipaddress
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from disagg.addresses import WILDCARDS, is_this_machine, local_addresses
from disagg.errors import ErrorSink, TopologyError
from disagg.topology import InstanceSpec, Topology

#: vLLM's default share of a GPU's memory for one engine (``--gpu-memory-utilization``)
VLLM_GPU_MEMORY_DEFAULT = 0.9
#: how a model written as a local path starts (anything else is a Hugging Face id, or a path that exists)
LOCAL_PATH_PREFIXES = ("/", "./", "../", "~")
#: SGLang's flag for the same share (its default depends on the GPU; taken as vLLM's)
GPU_MEMORY_FLAGS = {"vllm": ("--gpu-memory-utilization",), "sglang": ("--mem-fraction-static",)}


@dataclass(frozen=True)
class Finding:
    """One problem of a topology file, where it is written."""

    file: str
    line: int | None
    field: str
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line is not None else self.file
        return f"{where}: {self.field}: {self.message}"

    def error(self) -> TopologyError:
        return TopologyError(self.file, self.line, self.field, self.message)

    def as_dict(self) -> dict[str, object]:
        return {"file": self.file, "line": self.line, "field": self.field, "message": self.message}


def _finding(topo: Topology, path: str, message: str) -> Finding:
    return Finding(topo.file, topo.where(path), path, message)


def _usable_cpus() -> set[int]:
    """The CPU ids this process may run on (its affinity; all of ``os.cpu_count`` without one)."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return set(range(os.cpu_count() or 1))


def host_findings(topo: Topology, *, local: Iterable[str] | None = None, cpus: set[int] | None = None,
                  hostname: str | None = None) -> list[Finding]:
    """What cannot run on this machine, for the hosts without ``ssh`` (defaults: this machine's
    addresses, usable CPUs and host name; tests pass their own)."""
    found: list[Finding] = []
    addresses = frozenset(local_addresses() if local is None else local)
    usable = _usable_cpus() if cpus is None else cpus
    emulated = topo.link.type == "emulated"
    for name, host in topo.hosts.items():
        if host.is_remote or emulated:
            continue
        if not is_this_machine(host.address, addresses, hostname):
            found.append(_finding(topo, f"hosts.{name}.address", (
                f"{host.address} is not an address of this machine, and the host has no ssh: its "
                "engines would bind an address they do not have; add ssh: user@host for a remote "
                "host, or use an address of this machine")))
    proxy_emulated = emulated and topo.proxy.host in {h.address for h in topo.hosts.values()}
    if not proxy_emulated and not is_this_machine(topo.proxy.host, addresses, hostname):
        found.append(_finding(topo, "proxy.host", f"{topo.proxy.host} is not an address of this machine "
                                                  "(the proxy runs here)"))
    for inst in topo.instances:
        if topo.hosts[inst.host].is_remote:
            continue
        beyond = sorted(set(inst.cpus) - usable)
        if beyond:
            found.append(_finding(topo, f"roles.{inst.name}.cpus", (
                f"CPU {', '.join(map(str, beyond))} is not one this machine lets disagg use "
                f"(CPUs {_ranges(usable)})")))
    model = topo.model
    written_as_path = model.embedded is None and model.source.startswith(LOCAL_PATH_PREFIXES)
    missing: set[str] = set()
    for name in dict.fromkeys(i.host for i in topo.instances):
        host = topo.hosts[name]
        if host.is_remote or (host.model is None and not written_as_path):
            continue
        path = topo.model_path(host)
        if path in missing or Path(path).exists():
            continue
        missing.add(path)
        field = (f"hosts.{name}.model" if host.model is not None
                 else "model.path" if "model.path" in topo.lines else "model")
        found.append(_finding(topo, field, f"{path} does not exist on this machine "
                                           "(a local engine loads the model from there)"))
    return found


def _ranges(cpus: set[int]) -> str:
    out: list[str] = []
    for cpu in sorted(cpus):
        if out and out[-1].endswith(f"-{cpu - 1}"):
            out[-1] = out[-1].rsplit("-", 1)[0] + f"-{cpu}"
        elif out and out[-1] == str(cpu - 1):
            out[-1] += f"-{cpu}"
        else:
            out.append(str(cpu))
    return ",".join(out) or "none"


def _gpu_share(topo: Topology, inst: InstanceSpec) -> float:
    """The share of its GPU's memory the instance's engine takes (its flag, else vLLM's default)."""
    value = inst.arg(*GPU_MEMORY_FLAGS.get(topo.engine, ()))
    try:
        return float(value) if value is not None else VLLM_GPU_MEMORY_DEFAULT
    except ValueError:
        return VLLM_GPU_MEMORY_DEFAULT


def advisories(topo: Topology) -> list[Finding]:
    """Settings that work but are probably not meant (warnings wherever the file is read)."""
    found: list[Finding] = []
    sharing: dict[tuple[str, int], list[InstanceSpec]] = {}
    for inst in topo.instances:
        if topo.hosts[inst.host].device == "cuda":
            for gpu in inst.gpus or (0,):
                sharing.setdefault((inst.host, gpu), []).append(inst)
    for (host_name, gpu), insts in sharing.items():
        total = sum(_gpu_share(topo, i) for i in insts)
        if len(insts) > 1 and total > 1.0:
            names = ", ".join(i.name for i in insts)
            found.append(_finding(topo, f"roles.{insts[-1].name}.gpus", (
                f"{names} share GPU {gpu} of host {host_name} and would take {total:.2f} of its memory "
                f"(--gpu-memory-utilization, vLLM's default {VLLM_GPU_MEMORY_DEFAULT}); the second "
                "to start fails for lack of memory: give each a share so they add up to at most 1")))
    if topo.proxy.host in WILDCARDS and not topo.proxy.api_key and topo.proxy.kind == "builtin":
        found.append(_finding(topo, "proxy.host", (
            f"{topo.proxy.host} serves every network this machine is on, and proxy.api_key is not set: "
            "anyone who reaches the port may use the model")))
    for name, host in topo.hosts.items():
        if host.is_remote and _loopback(host.address):
            found.append(_finding(topo, f"hosts.{name}.address", (
                f"{host.address} is a loopback address, but the host is reached over ssh ({host.ssh}): "
                "the other hosts cannot reach its engines there")))
    return found


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address.lower() == "localhost"


def warn(findings: Iterable[Finding]) -> None:
    """Each finding on stderr as ``disagg: warning: file:line: field: message``."""
    for finding in findings:
        try:
            print(f"disagg: warning: {finding}", file=sys.stderr)
        except OSError:
            pass


def require_runnable_here(topo: Topology) -> None:
    """``disagg up``'s check: raise every :func:`host_findings` at once (a TopologyError, or
    TopologyErrors), and print the :func:`advisories` as warnings."""
    sink = ErrorSink()
    for finding in host_findings(topo):
        sink.add(finding.error())
    sink.raise_if_any()
    warn(advisories(topo))
