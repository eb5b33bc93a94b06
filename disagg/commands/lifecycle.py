"""``disagg up``, ``disagg down`` and ``disagg status``."""

from __future__ import annotations

import argparse
import signal
import sys
from types import FrameType

from disagg.deployment import plan_deployment
from disagg.launch import processes
from disagg.launch.health import http_status
from disagg.launch.launcher import Launcher, resolve_state, stop_run
from disagg.topology import load_topology


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``up``, ``down`` and ``status``."""
    p = sub.add_parser("up", help="start every engine and the proxy of a topology")
    p.add_argument("topology", metavar="TOPOLOGY.yaml")
    p.add_argument("--detach", "-d", action="store_true",
                   help="return once everything is healthy (stop later with `disagg down`)")
    p.add_argument("--run-dir", help="state and logs directory (default: the topology's run_dir, .disagg)")
    p.set_defaults(handler=cmd_up)

    p = sub.add_parser("down", help="stop everything `disagg up` started")
    p.add_argument("topology", nargs="?", metavar="TOPOLOGY.yaml",
                   help="which run to stop (default: the only one running)")
    p.add_argument("--run-dir", default=None)
    p.add_argument("--grace", type=float, default=None, help="seconds between SIGTERM and SIGKILL")
    p.set_defaults(handler=cmd_down)

    p = sub.add_parser("status", help="show the processes of a running topology and probe them")
    p.add_argument("topology", nargs="?", metavar="TOPOLOGY.yaml")
    p.add_argument("--run-dir", default=None)
    p.set_defaults(handler=cmd_status)


class _Signals:
    """SIGINT/SIGTERM set a flag; a second signal asks for a forced stop."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        if self.count == 1:
            print("\nstopping (Ctrl-C again to force)...", file=sys.stderr, flush=True)

    @property
    def stop(self) -> bool:
        return self.count > 0


def cmd_up(args: argparse.Namespace) -> int:
    """Start a topology; in the foreground, supervise until Ctrl-C."""
    topo = load_topology(args.topology, run_dir=args.run_dir)
    launcher = Launcher(plan_deployment(topo))
    if args.detach:
        launcher.up()
        print(f"detached; stop with: disagg down {args.topology}")
        return 0
    signals = _Signals()
    previous = {s: signal.signal(s, signals) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            launcher.up()
        except KeyboardInterrupt:
            return 130
        if signals.stop:
            launcher.stop()
            return 130
        print("serving; Ctrl-C stops every process", flush=True)
        status = launcher.supervise(lambda: signals.stop)
        launcher.stop(grace=0.0 if signals.count > 1 else None)
        return status
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _state_for(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    if args.topology:
        topo = load_topology(args.topology, run_dir=args.run_dir)
        return resolve_state(topo.run_dir, topo.name), topo.timeouts.shutdown_grace
    return resolve_state(args.run_dir or ".disagg", None), 20.0


def cmd_down(args: argparse.Namespace) -> int:
    """Stop every process a run state lists."""
    run, grace = _state_for(args)
    stop_run(run, grace=args.grace if args.grace is not None else grace, echo=lambda s: print(s, flush=True))
    print(f"{run.name}: down")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """Print each process of a run with liveness and health; exit 1 if any is unhealthy."""
    run, _ = _state_for(args)
    print(f"{run.name}: proxy {run.proxy_url} (topology {run.topology})")
    bad = 0
    for rec in run.processes:
        alive = processes.is_alive(rec)
        code = http_status(rec.url + "/health") if alive else None
        state = "healthy" if code == 200 else ("running, /health " + str(code) if alive else "not running")
        bad += code != 200
        where = f"{rec.host} via ssh" if rec.ssh else rec.host
        print(f"  {rec.name:<11} {rec.address}:{rec.port:<6} pid {rec.pid:<8} {where:<12} {state}  log {rec.log}")
    return 1 if bad else 0
