"""``disagg up``, ``disagg down`` and ``disagg status``."""

from __future__ import annotations

import argparse
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any, cast

from disagg.deployment import build_deployment
from disagg.doctor import preflight
from disagg.errors import NotRunningError, StateError
from disagg.launch import processes
from disagg.launch.health import http_status
from disagg.launch.launcher import Launcher, resolve_state, stop_run
from disagg.launch.state import STATE_FILE, RunState, live_states, load_state, lock_holder
from disagg.paths import LOGS, run_path
from disagg.topology import DEFAULT_RUN_DIR, Timeouts, load_topology
from disagg.topology_checks import require_runnable_here


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``up``, ``down`` and ``status``."""
    p = sub.add_parser("up", help="start every engine and the proxy of a topology")
    p.add_argument("topology", metavar="TOPOLOGY.yaml")
    p.add_argument("--detach", "-d", action="store_true",
                   help="return once everything is healthy (stop later with `disagg down`)")
    p.add_argument("--run-dir", help="state and logs directory (default: the topology's run_dir, .disagg)")
    # the detached supervisor: `up --detach` starts `up --supervisor-fd N` in a session of its own
    p.add_argument("--supervisor-fd", type=int, default=None, help=argparse.SUPPRESS)
    p.set_defaults(handler=cmd_up)

    p = sub.add_parser("down", help="stop everything `disagg up` started")
    p.add_argument("topology", nargs="?", metavar="TOPOLOGY.yaml",
                   help="which run to stop (default: the only one running)")
    p.add_argument("--run-dir", default=None)
    p.add_argument("--grace", type=float, default=None, help="seconds between SIGTERM and SIGKILL")
    p.set_defaults(handler=cmd_down)

    p = sub.add_parser("status", help="show the processes of a running topology (default: every live run) "
                                      "and probe them")
    p.add_argument("topology", nargs="?", metavar="TOPOLOGY.yaml")
    p.add_argument("--run-dir", default=None)
    p.add_argument("--json", action="store_true", help="the same as one JSON object")
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


def _echo(line: str) -> None:
    """The launcher's output: stdout, which for the detached supervisor is a pipe to the waiting
    `up --detach` until it is ready; if that `up` was killed, carry on (stopping included) silently.
    Other write errors (a full disk under the supervisor's log) are raised for the launcher's
    :class:`~disagg.launch.launcher.BestEffort` to report once."""
    try:
        print(line, flush=True)
    except BrokenPipeError:  # nobody reads any more
        pass


def _tell(line: str) -> None:
    """A line to stdout from `down` or the supervisor's own start that never raises: on a full disk
    or a closed pipe the stop goes on without it."""
    try:
        print(line, flush=True)
    except OSError:
        pass


def _say(line: str) -> None:
    """A line to stderr that never raises: the signal handler calls it before telling the launcher,
    and an exception there (the detached supervisor's stderr is a pipe whose reader may be gone)
    would skip the stop and land anywhere in start-up, e.g. between starting an engine and
    recording it."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (RuntimeError, OSError):  # a signal inside another write to stderr; BrokenPipeError
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
    """Start a topology and supervise it (restarts, see ``disagg.launch.supervisor``) until Ctrl-C.

    Ctrl-C (or SIGTERM) at any moment stops everything started so far; the run's
    lock is held until this returns. ``--detach`` runs the same in a supervisor
    process of its own (:func:`detach`) and returns once everything is healthy.
    """
    if args.detach and args.supervisor_fd is None:
        return detach(args)
    topo = load_topology(args.topology, run_dir=args.run_dir)
    if args.supervisor_fd is None:  # `up --detach` checked before starting the supervisor
        require_runnable_here(topo)
        preflight(build_deployment(topo))
    launcher = Launcher(build_deployment(topo), echo=_echo)
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
            try:
                if args.supervisor_fd is not None:
                    _detached(args.supervisor_fd, launcher)
                else:
                    print("serving; Ctrl-C stops every process", flush=True)
                return launcher.supervise(lambda: signals.stop)
            finally:   # also when supervising failed: nothing this run started outlives it
                launcher.stop(grace=0.0 if signals.count > 1 else None)
        finally:
            launcher.release()


#: after `ready`, how long to wait for the rest of the supervisor's start-up output
DRAIN_S = 2.0


def supervisor_log(run_dir: str, name: str) -> Path:
    """Where a detached supervisor writes once ``up --detach`` has returned."""
    return run_path(run_dir, name) / LOGS / "supervisor.log"


def _detached(fd: int, launcher: Launcher) -> None:
    """In the supervisor process, once up: from now on write to the supervisor log, then tell
    the waiting ``up --detach`` that it may return (one line on ``fd``)."""
    log = supervisor_log(launcher.run.run_dir, launcher.topo.name)
    log.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    _tell(f"supervising (pid {os.getpid()}); restarts are reported here")
    try:
        os.write(fd, b"ready\n")
    except OSError:
        pass  # the waiting `up` is gone: supervise anyway, `disagg down` stops us
    finally:
        os.close(fd)


def detach(args: argparse.Namespace) -> int:
    """``up --detach``: start ``up --supervisor-fd`` in a session of its own, relay its output
    until it says it is supervising (exit 0) or exits (its exit status).

    The supervisor holds the run's lock and secrets in memory and restarts what exits;
    ``disagg down`` asks it to stop everything (SIGTERM). Ctrl-C here is passed on to it
    during start-up (it stops what it started) and this waits for it to exit.
    """
    topo = load_topology(args.topology, run_dir=args.run_dir)  # errors here, before anything starts
    require_runnable_here(topo)
    preflight(build_deployment(topo))  # doctor's cheap checks on every host
    ready_r, ready_w = os.pipe()
    argv = [sys.executable, "-m", "disagg", "up", args.topology, "--supervisor-fd", str(ready_w)]
    if args.run_dir:
        argv += ["--run-dir", args.run_dir]
    child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             pass_fds=(ready_w,), start_new_session=True)
    os.close(ready_w)
    signals = _Signals()
    with _handling(signals):
        ready = _relay_until_ready(child, ready_r, signals)
    if ready:
        print(f"detached: supervisor pid {child.pid} restarts what exits (log "
              f"{supervisor_log(topo.run_dir, topo.name)}); stop with: disagg down {args.topology}", flush=True)
        return 0
    code = child.wait()
    return 130 if signals.stop else code


def _relay_until_ready(child: subprocess.Popen[bytes], ready_fd: int, signals: _Signals) -> bool:
    """Copy the child's stdout/stderr to ours until it writes ``ready`` on ``ready_fd`` (True)
    or closes everything (False: it exited); pass each Ctrl-C on to it as SIGTERM."""
    assert child.stdout is not None and child.stderr is not None
    sinks = {child.stdout.fileno(): sys.stdout, child.stderr.fileno(): sys.stderr}
    with selectors.DefaultSelector() as sel:
        for fd in (*sinks, ready_fd):
            sel.register(fd, selectors.EVENT_READ)
        forwarded, ready, open_fds, ready_at = 0, False, {*sinks, ready_fd}, 0.0
        while open_fds:
            if signals.count > forwarded:
                forwarded = signals.count
                _signal(child, signal.SIGTERM)
            for key, _ in sel.select(timeout=0.2):
                fd = key.fd
                data = os.read(fd, 65536)
                if not data:
                    sel.unregister(fd)
                    open_fds.discard(fd)
                elif fd == ready_fd:
                    if not ready and data.startswith(b"ready"):
                        ready, ready_at = True, time.monotonic()
                else:
                    sinks[fd].write(data.decode("utf-8", errors="replace"))
                    sinks[fd].flush()
            if ready and time.monotonic() - ready_at > DRAIN_S:
                break  # its stdout/stderr moved to the supervisor log before `ready`; a copy kept them open
    os.close(ready_fd)
    child.stdout.close()
    child.stderr.close()
    return ready


def _signal(child: subprocess.Popen[bytes], sig: int) -> None:
    try:
        child.send_signal(sig)
    except ProcessLookupError:
        pass


def _state_for(args: argparse.Namespace) -> tuple[RunState, Timeouts]:
    """The run state, and the topology's timeouts (the defaults when no topology file is named).

    Without ``--run-dir`` a run is found from any directory: this directory's ``.disagg`` or the
    topology's ``run_dir`` first, then this user's live runs (``disagg.launch.live``)."""
    anywhere = args.run_dir is None
    if args.topology:
        topo = load_topology(args.topology, run_dir=args.run_dir)
        return (resolve_state(topo.run_dir, topo.name, anywhere=anywhere, topology_file=topo.file),
                topo.timeouts)
    return resolve_state(args.run_dir or DEFAULT_RUN_DIR, None, anywhere=anywhere), Timeouts()


def _stop_owner(run_dir: str, name: str, grace: float) -> bool:
    """Ask a `disagg up` that still holds the run's lock to stop everything itself (SIGTERM), and wait.

    True when such an owner was there and has let go of the lock.
    """
    holder = lock_holder(run_dir, name)
    if not holder or holder == os.getpid():
        return False
    _tell(f"{name}: `disagg up` (pid {holder}) still owns this run; asking it to stop (SIGTERM)")
    try:
        os.kill(holder, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + grace + 30
    while lock_holder(run_dir, name) is not None:
        if time.monotonic() > deadline:
            _tell(f"{name}: pid {holder} did not let go within {grace + 30:.0f} s; stopping its processes here")
            return False
        time.sleep(0.2)
    return True


def cmd_down(args: argparse.Namespace) -> int:
    """Stop every process a run state lists, whatever state each is in; exit 2 naming what could not be stopped.

    Ctrl-C while stopping skips the rest of the grace period (SIGKILL at once). Nothing running
    is no error: ``down`` says so and exits 0.
    """
    try:
        run, timeouts = _state_for(args)
    except NotRunningError as exc:
        _tell(f"{exc}; nothing to stop")
        return 0
    grace = args.grace if args.grace is not None else timeouts.shutdown_grace
    state_file = run_path(run.run_dir, run.name) / STATE_FILE
    if _stop_owner(run.run_dir, run.name, grace):
        if not state_file.exists():
            _tell(f"{run.name}: down")
            return 0
        run = load_state(state_file)
    signals = _Signals()
    with _handling(signals):
        stop_run(run, grace=grace, ssh_timeout=timeouts.ssh_check, echo=_tell, hurry=lambda: signals.stop)
    _tell(f"{run.name}: down")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """Print the supervisor and each process of a run (without a topology and ``--run-dir``: of every
    live run of this user) with liveness, health, restarts and the last exit; exit 1 if any process
    is unhealthy, 0 when nothing is running."""
    if not args.topology and args.run_dir is None:
        runs = []
        for path in live_states(DEFAULT_RUN_DIR):
            try:
                runs.append(load_state(path))
            except StateError as exc:
                print(f"disagg: warning: {exc}", file=sys.stderr)
        timeouts = Timeouts()
    else:
        try:
            one, timeouts = _state_for(args)
        except NotRunningError:
            runs = []
        else:
            runs = [one]
    reports = [_run_report(run, timeouts) for run in runs]
    bad = sum(1 for r in reports for p in cast("list[dict[str, Any]]", r["processes"]) if not p["healthy"])
    as_json = getattr(args, "json", False)
    if as_json:
        print(json.dumps({"runs": reports}, indent=2))
    elif not reports:
        print("nothing is running")
    for index, report in enumerate([] if as_json else reports):
        if index:
            print()
        _print_run(report)
    return 1 if bad else 0


def _run_report(run: RunState, timeouts: Timeouts) -> dict[str, Any]:
    """One run, probed: its supervisor and each process's state (``status`` and ``status --json``)."""
    holder = lock_holder(run.run_dir, run.name)
    procs = []
    for rec in run.processes:
        found = processes.liveness(rec, ssh_timeout=timeouts.ssh_check)
        alive = found is processes.Liveness.RUNNING
        code = http_status(rec.url + "/health") if alive else None
        if rec.status == "backoff" and holder:
            state = "exited; waiting to be restarted"
        elif rec.status == "starting" and holder and alive:
            state = "restarted; starting"
        elif found is processes.Liveness.RUNNING:
            state = "healthy" if code == 200 else f"running, /health {code}"
        elif found is processes.Liveness.LEFTOVERS:
            state = "not running (leader exited; processes of its group remain: `disagg down` stops them)"
        elif found is processes.Liveness.UNREACHABLE:
            state = "unknown (host unreachable over ssh)"
        elif rec.status == "failed":
            state = "failed: not restarted again (restart policy or restart.max)"
        else:
            state = "not running"
        procs.append({"name": rec.name, "kind": rec.kind, "host": rec.host, "ssh": bool(rec.ssh),
                      "address": rec.address, "port": rec.port, "pid": rec.pid, "state": state,
                      "healthy": code == 200, "restarts": rec.restarts, "last_exit": rec.last_exit,
                      "log": rec.log, "exit_log": rec.exit_log})
    return {"name": run.name, "topology": run.topology, "run_dir": run.run_dir, "proxy_url": run.proxy_url,
            "supervisor_pid": holder or None,
            "supervisor_log": str(supervisor_log(run.run_dir, run.name)), "processes": procs}


def _print_run(report: dict[str, Any]) -> None:
    print(f"{report['name']}: proxy {report['proxy_url']} (topology {report['topology']})")
    if report["supervisor_pid"]:
        print(f"  supervisor  pid {report['supervisor_pid']}: restarts what exits (log {report['supervisor_log']})")
    else:
        print("  supervisor  not running: nothing restarts what exits (`disagg down`, then `disagg up`)")
    for p in report["processes"]:
        where = f"{p['host']} via ssh" if p["ssh"] else p["host"]
        history = f"  restarts {p['restarts']}" + (f", last exit: {p['last_exit']}" if p["last_exit"] else "")
        print(f"  {p['name']:<11} {p['address']}:{p['port']:<6} pid {p['pid']:<8} {where:<12} {p['state']}{history}"
              f"  log {p['log']}")
        if p["exit_log"]:
            print(f"    last lines of its log when it exited ({p['last_exit']}):")
            print("\n".join(f"      {line}" for line in p["exit_log"].splitlines()))
