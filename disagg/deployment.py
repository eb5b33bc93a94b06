"""Topology -> the exact processes to start: argv, env, URL, log file per engine.

This is what ``disagg check`` prints and ``disagg up`` runs; it does no I/O.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from disagg.registry import engine_adapter
from disagg.topology import HostSpec, InstanceSpec, Topology


@dataclass(frozen=True)
class EngineLaunch:
    """One engine process, fully resolved."""

    instance: InstanceSpec
    host: HostSpec
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]      # set on top of the inherited environment
    health_path: str
    #: config files written into the run directory on its host before start (name, contents)
    files: tuple[tuple[str, str], ...] = ()

    @property
    def name(self) -> str:
        return self.instance.name

    @property
    def url(self) -> str:
        """Base URL of the engine's HTTP server."""
        return f"http://{_url_host(self.host.address)}:{self.instance.port}"

    @property
    def log_name(self) -> str:
        """File name of the engine's log inside the run directory."""
        return f"{self.instance.role}-{self.instance.index}.log"

    def shell_command(self) -> str:
        """``env K=V ... argv`` quoted for a POSIX shell (used over SSH)."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env)
        cmd = " ".join(shlex.quote(a) for a in self.argv)
        return f"env {env} {cmd}" if env else cmd


@dataclass(frozen=True)
class Deployment:
    """Every engine of a topology plus the proxy address."""

    topology: Topology
    engines: tuple[EngineLaunch, ...]

    @property
    def proxy_url(self) -> str:
        return f"http://{_url_host(self.topology.proxy.host)}:{self.topology.proxy.port}"

    def role(self, role: str) -> tuple[EngineLaunch, ...]:
        return tuple(e for e in self.engines if e.instance.role == role)


def _url_host(address: str) -> str:
    if address in ("0.0.0.0", ""):
        return "127.0.0.1"
    return f"[{address}]" if ":" in address else address


def python_for(host: HostSpec) -> str:
    """The interpreter that runs engines on ``host``."""
    if host.python:
        return host.python
    return "python3" if host.is_remote else sys.executable


def host_run_dir(topo: Topology, host: HostSpec) -> str:
    """The topology's run directory on ``host``: ``<run_dir>/runs/<name>`` here (absolute),
    ``<workdir>/runs/<name>`` on a remote host (relative paths start at the SSH login's home)."""
    if host.is_remote:
        return str(PurePosixPath(host.workdir or ".disagg") / "runs" / topo.name)
    return str(Path(topo.run_dir).resolve() / "runs" / topo.name)


def plan_deployment(topo: Topology) -> Deployment:
    """Resolve every instance of ``topo`` into an :class:`EngineLaunch`."""
    adapter = engine_adapter(topo.engine)
    engines = []
    for inst in topo.instances:
        host = topo.hosts[inst.host]
        argv = adapter.argv(topo, inst, host, python_for(host))
        env = adapter.env(topo, inst, host)
        files = adapter.files(topo, inst, host)
        engines.append(EngineLaunch(instance=inst, host=host, argv=tuple(argv),
                                    env=tuple(sorted(env.items())), health_path=adapter.health_path,
                                    files=tuple(sorted(files.items()))))
    return Deployment(topology=topo, engines=tuple(engines))


def describe(dep: Deployment) -> str:
    """The human-readable plan printed by ``disagg check``."""
    topo = dep.topology
    lines = [f"topology {topo.name} ({topo.file})",
             f"  model     {topo.model.source}" + (f" -> {topo.model.path}" if topo.model.path != topo.model.source
                                                   else ""),
             f"  engine    {topo.engine}",
             "  mode      " + ("colocated (no KV transfer)" if topo.colocated
                                else f"disaggregated, connector {topo.connector}"),
             f"  link      {topo.link.type}" + (f" {topo.link.rate_text}" if topo.link.rate_text else ""),
             f"  proxy     {dep.proxy_url} (fallback: {topo.proxy.fallback}"
             + (", api key set" if topo.proxy.api_key else "") + ")"]
    key_env = engine_adapter(topo.engine).key_env(topo)
    lines.append(f"  engines   answer only the proxy: `up` puts a per-run key in {key_env} of each engine "
                 "and the proxy sends it" if key_env else
                 "  engines   not guarded by a key (anyone who reaches their ports may use them)")
    if topo.link.type == "emulated":
        from disagg.launch.emulation import emulated_link, prefill_host
        link = emulated_link(topo)
        lines.append(f"  netns     {prefill_host(topo).name} runs in network namespace {link.a.namespace} "
                     f"behind veth {link.a.interface}/{link.b.interface}, tc tbf {topo.link.rate_text} "
                     "both ways; decode and proxy stay in the root namespace")
    for host in topo.hosts.values():
        where = f"ssh {host.ssh}" + (f" -p {host.ssh_port}" if host.ssh_port else "") if host.is_remote else "local"
        lines.append(f"host {host.name}: address {host.address}, {where}, device {host.device}")
        for eng in (e for e in dep.engines if e.host.name == host.name):
            inst = eng.instance
            ports = f"http {inst.port}" + (f", kv {inst.kv_port}" if inst.kv_port else "")
            pin = f", cpus {','.join(map(str, inst.cpus))}" if inst.cpus else ""
            pin += f", gpus {','.join(map(str, inst.gpus))}" if inst.gpus else ""
            lines.append(f"  {eng.name}: {eng.url} ({ports}{pin})")
            lines.append("    env:  " + (" ".join(f"{k}={shlex.quote(v)}" for k, v in eng.env) or "(none)"))
            lines.append("    argv: " + " ".join(shlex.quote(a) for a in eng.argv))
            for fname, text in eng.files:
                lines.append(f"    file: {fname}")
                lines += [f"      | {line}" for line in text.splitlines()]
    ports = sorted({(e.host.address, p) for e in dep.engines
                    for p in (e.instance.port, e.instance.kv_port) if p})
    ports.append((topo.proxy.host, topo.proxy.port))
    from disagg.launch.frontend import frontend_argv  # the launcher's module; imports nothing heavy

    lines.append(f"proxy ({topo.proxy.kind}): " + " ".join(shlex.quote(a) for a in frontend_argv(dep)))
    lines.append("ports: " + ", ".join(f"{a}:{p}" for a, p in ports))
    return "\n".join(lines)
