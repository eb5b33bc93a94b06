"""``disagg doctor`` (is every host ready?) and ``disagg setup`` (make the remote hosts so)."""

from __future__ import annotations

import argparse
import json
import time

from disagg.deployment import build_deployment
from disagg.doctor import run_doctor
from disagg.doctor.checks import as_json
from disagg.doctor.setup import run_setup
from disagg.doctor.table import render
from disagg.topology import load_topology


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``doctor`` and ``setup``."""
    p = sub.add_parser("doctor", help="check every host of a topology before `up` (seconds; exit 0 when all pass)")
    p.add_argument("topology", metavar="TOPOLOGY.yaml")
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds for all hosts' answers (default: the topology's timeouts.ssh_check)")
    p.set_defaults(handler=cmd_doctor)

    p = sub.add_parser("setup", help="copy the venv and the model to each remote host (resumable)")
    p.add_argument("topology", metavar="TOPOLOGY.yaml")
    p.add_argument("--venv", default=None,
                   help="the venv to copy (default: a local host's venv, else the one running disagg)")
    p.set_defaults(handler=cmd_setup)


def cmd_doctor(args: argparse.Namespace) -> int:
    """Run every check, print the table (or JSON); 0 only when nothing failed."""
    dep = build_deployment(load_topology(args.topology))
    started = time.monotonic()
    found = run_doctor(dep, timeout=args.timeout)
    report = as_json(found)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(render(found, elapsed=time.monotonic() - started))
    return 0 if report["ok"] else 1


def cmd_setup(args: argparse.Namespace) -> int:
    """Bring each remote host to what doctor wants; 1 when a host needs a command run by hand."""
    dep = build_deployment(load_topology(args.topology))
    done = run_setup(dep, venv=args.venv, say=lambda line: print(line, flush=True))
    print("setup done; `disagg doctor` checks the rest" if done
          else "setup incomplete: run the commands above, then `disagg setup` again")
    return 0 if done else 1
