"""``disagg up``, ``disagg down`` and ``disagg status``."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

from disagg.deployment import plan_deployment
from disagg.launch import processes
from disagg.launch.health import http_status
from disagg.launch.launcher import Launcher, resolve_state, stop_run
from disagg.launch.state import STATE_FILE, load_state, lock_holder, run_path
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
    """SIGINT/SIGTERM handler: tells the launcher (which may raise KeyboardInterrupt
    during start-up, see ``Launcher.interrupt``); a second signal makes the stop immediate."""

    def __init__(self, launcher: Launcher | None = None) -> None:
        self.count = 0
        self.launcher = launcher

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        _say("\nstopping (Ctrl-C again to force)..." if self.count == 1 else "\nforcing: SIGKILL to what is left")
        if self.launcher is not None:
            self.launcher.interrupt()

    @property
    def stop(self) -> bool:
        return self.count > 0


def _say(line: str) -> None:
    try:
        print(line, file=sys.stderr, flush=True)
    except RuntimeError:  # a signal landed inside another write to stderr
        pass


@contextmanager
def _handling(signals: _Signals) -> Iterator[None]:
    previous = {s: signal.signal(s, signals) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def cmd_up(args: argparse.Namespace) -> int:
    """Start a topology; in the foreground, supervise until Ctrl-C.

    Ctrl-C (or SIGTERM) at any moment stops everything started so far; the run's
    lock is held until this returns (``--detach``: until everything is healthy).
    """
    topo = load_topology(args.topology, run_dir=args.run_dir)
    launcher = Launcher(plan_deployment(topo))
    signals = _Signals(launcher)
    with _handling(signals):
        try:
            try:
                launcher.up()
            except KeyboardInterrupt:
                return 130
            if signals.stop:
                launcher.stop(grace=0.0 if signals.count > 1 else None)
                return 130
            if args.detach:
                print(f"detached; stop with: disagg down {args.topology}")
                return 0
            print("serving; Ctrl-C stops every process", flush=True)
            status = launcher.supervise(lambda: signals.stop)
            launcher.stop(grace=0.0 if signals.count > 1 else None)
            return status
        finally:
            launcher.release()


def _state_for(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    if args.topology:
        topo = load_topology(args.topology, run_dir=args.run_dir)
        return resolve_state(topo.run_dir, topo.name), topo.timeouts.shutdown_grace
    return resolve_state(args.run_dir or ".disagg", None), 20.0


def _stop_owner(run_dir: str, name: str, grace: float) -> bool:
    """Ask a `disagg up` that still holds the run's lock to stop everything itself (SIGTERM), and wait.

    True when such an owner was there and has let go of the lock.
    """
    holder = lock_holder(run_dir, name)
    if not holder or holder == os.getpid():
        return False
    print(f"{name}: `disagg up` (pid {holder}) still owns this run; asking it to stop (SIGTERM)", flush=True)
    try:
        os.kill(holder, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + grace + 30
    while lock_holder(run_dir, name) is not None:
        if time.monotonic() > deadline:
            print(f"{name}: pid {holder} did not let go within {grace + 30:.0f} s; stopping its processes here",
                  flush=True)
            return False
        time.sleep(0.2)
    return True


def cmd_down(args: argparse.Namespace) -> int:
    """Stop every process a run state lists, whatever state each is in; exit 2 naming what could not be stopped.

    Ctrl-C while stopping skips the rest of the grace period (SIGKILL at once).
    """
    run, grace = _state_for(args)
    grace = args.grace if args.grace is not None else grace
    state_file = run_path(run.run_dir, run.name) / STATE_FILE
    if _stop_owner(run.run_dir, run.name, grace):
        if not state_file.exists():
            print(f"{run.name}: down")
            return 0
        run = load_state(state_file)
    signals = _Signals()
    with _handling(signals):
        stop_run(run, grace=grace, echo=lambda s: print(s, flush=True), hurry=lambda: signals.stop)
    print(f"{run.name}: down")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """Print each process of a run with liveness and health; exit 1 if any is unhealthy."""
    run, _ = _state_for(args)
    print(f"{run.name}: proxy {run.proxy_url} (topology {run.topology})")
    bad = 0
    for rec in run.processes:
        found = processes.liveness(rec)
        alive = found is processes.Liveness.RUNNING
        code = http_status(rec.url + "/health") if alive else None
        if found is processes.Liveness.RUNNING:
            state = "healthy" if code == 200 else f"running, /health {code}"
        elif found is processes.Liveness.LEFTOVERS:
            state = "not running (leader exited; processes of its group remain: `disagg down` stops them)"
        elif found is processes.Liveness.UNREACHABLE:
            state = "unknown (host unreachable over ssh)"
        else:
            state = "not running"
        bad += code != 200
        where = f"{rec.host} via ssh" if rec.ssh else rec.host
        print(f"  {rec.name:<11} {rec.address}:{rec.port:<6} pid {rec.pid:<8} {where:<12} {state}  log {rec.log}")
    return 1 if bad else 0
