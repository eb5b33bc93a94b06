"""Topology -> the exact processes to start: argv, env, URL, log file per engine.

This is what ``disagg check`` prints (``commands/basic.py``) and ``disagg up`` runs; it does no I/O.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, replace
from functools import partial

from disagg.engines.base import EngineAdapter
from disagg.errors import DeploymentError, ErrorSink, TopologyError
from disagg.registry import engine_adapter, vllm_kv_adapter
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
    #: log lines after which it never becomes ready (``EngineAdapter.stuck_start_lines``)
    stuck_start_lines: tuple[str, ...] = ()

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


def _flag(arg: str) -> str:
    """The flag an argv word gives (``--kv_transfer_config.kv_role=x`` -> ``--kv-transfer-config``)."""
    return arg.split("=", 1)[0].split(".", 1)[0].replace("_", "-")


def overridden_flags(adapter: EngineAdapter, topo: Topology, inst: InstanceSpec) -> list[str]:
    """The flags of the instance's ``args`` that the adapter's argv already sets (which the engine
    would take from whichever comes last, silently), in ``args`` order."""
    host = topo.hosts[inst.host]
    ours = {_flag(a) for a in adapter.argv(topo, replace(inst, args=()), host, python_for(host))
            if a.startswith("--")} - set(adapter.additive_flags)
    out: list[str] = []
    for arg in inst.args:
        if arg.startswith("--") and _flag(arg) in ours and _flag(arg) not in out:
            out.append(_flag(arg))
    return out


def _check_args(adapter: EngineAdapter, topo: Topology) -> None:
    """Refuse every instance ``args`` flag that disagg sets itself, all at once (file:line)."""
    sink = ErrorSink()
    for inst in topo.instances:
        flags = sink.attempt(partial(overridden_flags, adapter, topo, inst))
        if flags:
            where = f"roles.{inst.name}.args"
            sink.add(TopologyError(topo.file, topo.where(where) or inst.line or None, where,
                                   f"{', '.join(flags)} {'is' if len(flags) == 1 else 'are'} set by disagg "
                                   f"(from the topology: model, hosts, ports, connector); change the topology's "
                                   "field instead of overriding it here"))
    sink.raise_if_any()


def build_deployment(topo: Topology) -> Deployment:
    """Resolve every instance of ``topo`` into an :class:`EngineLaunch`; raises TopologyError(s)
    for ``args`` that override what the adapter sets (:func:`overridden_flags`)."""
    adapter = engine_adapter(topo.engine)
    if topo.engine == "vllm" and not topo.colocated:
        try:
            vllm_kv_adapter(topo.connector)
        except DeploymentError as exc:  # e.g. connector mooncake, which is SGLang's
            raise DeploymentError(f"{topo.located('connector')}: {exc}") from None
    _check_args(adapter, topo)
    engines = []
    for inst in topo.instances:
        host = topo.hosts[inst.host]
        argv = adapter.argv(topo, inst, host, python_for(host))
        env = adapter.env(topo, inst, host)
        files = adapter.files(topo, inst, host)
        engines.append(EngineLaunch(instance=inst, host=host, argv=tuple(argv),
                                    env=tuple(sorted(env.items())), health_path=adapter.health_path,
                                    files=tuple(sorted(files.items())), stuck_start_lines=adapter.stuck_start_lines))
    return Deployment(topology=topo, engines=tuple(engines))
