"""``disagg check`` and ``disagg make-model``."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import cast

from disagg.deployment import Deployment, build_deployment
from disagg.emulation import cpu_share_for, emulated_link, prefill_host
from disagg.errors import DisaggError, ErrorSink, TopologyError, TopologyErrors
from disagg.kv.ucx import UCX_PORT_RANGE_ENV
from disagg.launch.frontend import frontend_argv
from disagg.modelgen import EMBEDDED_MODELS, build_model
from disagg.registry import engine_adapter
from disagg.topology import Topology, load_topology
from disagg.topology_checks import advisories, host_findings, warn


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``check`` and ``make-model``."""
    p = sub.add_parser("check", help="validate topology files and print the resolved plan")
    p.add_argument("topologies", nargs="+", metavar="TOPOLOGY.yaml")
    p.add_argument("--here", action="store_true",
                   help="the files are for this machine: what `up` would refuse here (an address it lacks, "
                        "CPUs beyond its cores, a missing model path) is an error, not a warning")
    p.add_argument("--json", action="store_true",
                   help="one JSON object per run: each file's errors, warnings and planned engines")
    p.set_defaults(handler=cmd_check)

    p = sub.add_parser("make-model", help="build an embedded tiny random-weight model (offline)")
    p.add_argument("directory", metavar="DIR")
    p.add_argument("--embedded", default="tiny", choices=sorted(EMBEDDED_MODELS),
                   help="which embedded model (default: tiny, 1 KiB KV per token)")
    p.set_defaults(handler=cmd_make_model)


def cmd_check(args: argparse.Namespace) -> int:
    """Validate each file; print its plan and its warnings (``disagg.topology_checks``; with
    ``--here`` what ``up`` would refuse on this machine is an error). Exit 2 if any file is invalid."""
    if args.json:
        reports = [_check_one(path, args.here) for path in args.topologies]
        print(json.dumps({"files": reports}, indent=2))
        return 2 if any(not r["valid"] for r in reports) else 0
    failed = 0
    for index, path in enumerate(args.topologies):
        if index:
            print()
        try:
            dep = build_deployment(load_topology(path))
            here = host_findings(dep.topology)
            if args.here and here:
                sink = ErrorSink()
                for finding in here:
                    sink.add(finding.error())
                sink.raise_if_any()
            print(describe(dep))
            warn([*here, *advisories(dep.topology)])
        except DisaggError as exc:
            if len(args.topologies) == 1:
                raise
            print(f"disagg: error: {exc}", file=sys.stderr)
            failed += 1
    return 2 if failed else 0


def _check_one(path: str, here: bool) -> dict[str, object]:
    """``check --json``'s report of one file."""
    report: dict[str, object] = {"file": path, "valid": False, "errors": [], "warnings": []}
    try:
        dep = build_deployment(load_topology(path))
    except TopologyErrors as exc:
        report["errors"] = [_error_dict(e) for e in exc.errors]
        return report
    except TopologyError as exc:
        report["errors"] = [_error_dict(exc)]
        return report
    except DisaggError as exc:
        report["errors"] = [{"file": path, "line": None, "field": "", "message": str(exc)}]
        return report
    topo = dep.topology
    found = host_findings(topo)
    report["errors" if here else "warnings"] = [f.as_dict() for f in found]
    report["warnings"] = [*cast("list[object]", report["warnings"]), *(f.as_dict() for f in advisories(topo))]
    report.update(valid=not (here and found), name=topo.name, proxy_url=dep.proxy_url,
                  engines=[{"name": e.name, "host": e.host.name, "url": e.url, "argv": list(e.argv),
                            "env": dict(e.env)} for e in dep.engines])
    return report


def _error_dict(exc: TopologyError) -> dict[str, object]:
    return {"file": exc.file, "line": exc.line, "field": exc.field, "message": exc.message}


def _mode(topo: Topology) -> str:
    """``disagg check``'s mode line: colocated, or the connector (and the socket connector's settings)."""
    if topo.colocated:
        return "colocated (no KV transfer)"
    settings = engine_adapter(topo.engine).connector_settings(topo)
    return f"disaggregated, connector {topo.connector}" + (f" ({settings})" if settings else "")


def describe(dep: Deployment) -> str:
    """The human-readable plan printed by ``disagg check``."""
    topo = dep.topology
    lines = [f"topology {topo.name} ({topo.file})",
             f"  model     {topo.model.source}" + (f" -> {topo.model.path}" if topo.model.path != topo.model.source
                                                   else ""),
             f"  engine    {topo.engine}",
             f"  mode      {_mode(topo)}",
             f"  link      {topo.link.type}" + (f" {topo.link.rate_text}" if topo.link.rate_text else ""),
             f"  proxy     {dep.proxy_url} (fallback: {topo.proxy.fallback}"
             + (", api key set" if topo.proxy.api_key else "") + ")"]
    key_env = engine_adapter(topo.engine).key_env(topo)
    lines.append(f"  engines   answer only the proxy: `up` puts a per-run key in {key_env} of each engine "
                 "and the proxy sends it" if key_env else
                 "  engines   not guarded by a key (anyone who reaches their ports may use them)")
    if topo.link.type == "emulated":
        link = emulated_link(topo)
        lines.append(f"  netns     {prefill_host(topo).name} runs in network namespace {link.a.namespace} "
                     f"behind veth {link.a.interface}/{link.b.interface}, tc tbf {topo.link.rate_text} "
                     "both ways; decode and proxy stay in the root namespace")
    for host in topo.hosts.values():
        where = f"ssh {host.ssh}" + (f" -p {host.ssh_port}" if host.ssh_port else "") if host.is_remote else "local"
        lines.append(f"host {host.name}: address {host.address}, {where}, device {host.device}")
        if host.emulate is not None:
            share = cpu_share_for(topo, host)
            lines.append(f"  {host.emulate.describe()}"
                         + (f"; `up` creates cgroup {share.name}, `down` removes it" if share else "")
                         + "; plan and routing use the rates measured on the running engines")
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
    listens = sorted({(e.host.address, p) for e in dep.engines
                      for p in (e.instance.port, e.instance.kv_port) if p})
    listens.append((topo.proxy.host, topo.proxy.port))
    lines.append(f"proxy ({topo.proxy.kind}): " + " ".join(shlex.quote(a) for a in frontend_argv(dep)))
    lines.append("ports: " + ", ".join(f"{a}:{p}" for a, p in listens))
    ucx = sorted({(e.host.address, dict(e.env)[UCX_PORT_RANGE_ENV]) for e in dep.engines
                  if UCX_PORT_RANGE_ENV in dict(e.env)})
    if ucx:
        lines.append("UCX ports (KV over TCP; open them too): " + ", ".join(f"{a}:{r}" for a, r in ucx))
    return "\n".join(lines)


def cmd_make_model(args: argparse.Namespace) -> int:
    """Build the embedded model into DIR."""
    out = build_model(args.embedded, Path(args.directory))
    cfg = EMBEDDED_MODELS[args.embedded]
    print(f"built embedded model {args.embedded!r} in {out} "
          f"({cfg.layers} layers, KV {cfg.kv_bytes_per_token} bytes/token)")
    return 0
