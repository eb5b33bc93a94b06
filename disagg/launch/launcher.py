"""Bring a deployment up, watch it, and take it down again.

``Launcher.up()`` takes the run's lock (``up.lock``), starts every engine
(locally or over SSH), waits for each ``/health``, then starts the proxy in
front of them and records everything in the run-state file. If anything fails
on the way, everything already started is stopped again before the error
propagates, so a failed ``up`` leaves no process behind.

Ctrl-C during start-up: :meth:`Launcher.interrupt` (called from the signal
handler) raises KeyboardInterrupt at once inside every wait (port checks,
building the model, waiting for ``/health``), and is held back only while a
process is being started and recorded, so nothing runs unrecorded; the
start-up code also checks for it between starts. Signals that arrive while
stopping make the stop immediate (SIGKILL) instead.

Once up, :meth:`Launcher.supervise` restarts what exits (see
:mod:`disagg.launch.supervisor`) with the same command line, environment and
run secrets, which only this process holds (in memory, never in a file).

``stop_run()`` stops what a state file lists: the proxy first, then every
engine at once (SIGTERM to each process group and session, the grace period,
SIGKILL), whatever state each leader is in. What cannot be stopped (its host
does not answer over SSH) is named in the error, and the state file is kept
listing only those.

Writes of the launcher's own (its output lines, which the detached supervisor
sends to ``supervisor.log``; the state file; the restart headings in engine
logs) are best-effort once the run is up (:class:`BestEffort`): a full disk
never stops supervision or a stop, and every stop signals every process.
Start-up alone still fails when it cannot write the state file, since
``disagg down`` needs it.
"""

from __future__ import annotations

import enum
import os
import secrets
import shlex
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from disagg import cpushare
from disagg.deployment import Deployment, EngineLaunch, python_for
from disagg.emulation import cpu_share_for, emulated_link, emulation_lines
from disagg.emulation import prefill_host as emulated_prefill_host
from disagg.engines.vllm import KEY_ENV as VLLM_KEY_ENV
from disagg.errors import (
    EngineStartError,
    HostUnreachableError,
    LaunchError,
    NotRunningError,
    PortInUseError,
    ProxyError,
    StateError,
)
from disagg.launch import processes
from disagg.launch.frontend import frontend_argv
from disagg.launch.health import busy_ports, http_status, local_port_free
from disagg.launch.live import live_dir
from disagg.launch.state import (
    STATE_FILE,
    ProcessRecord,
    RunLock,
    RunState,
    find_states,
    live_states,
    load_state,
    remove_state,
    save_state,
)
from disagg.launch.supervisor import Supervisor
from disagg.launch.tracked import OWN_LOG_LINE, HealthCheck, TrackedProcesses
from disagg.linkemu import EmulatedLink, remove_namespace
from disagg.modelgen import ensure_model
from disagg.paths import LOGS, PROXY_LOG, host_log, host_run_dir, run_path
from disagg.proxy.config import API_KEY_ENV, ENGINE_KEY_ENV, check_key
from disagg.registry import engine_adapter
from disagg.ssh import ssh_prefix
from disagg.topology import Topology, iter_ports

STOP_ORDER = {"proxy": 0, "decode": 1, "both": 2, "prefill": 3}
#: variables passed to remote engines over ssh's stdin, never on a command line, besides every
#: variable the launcher adds itself (the connector's per-run secrets, the engine key)
SECRET_ENVS = frozenset({VLLM_KEY_ENV})


#: what a failed write raises: OSError (a full disk: ENOSPC; a file system gone read-only),
#: ValueError (a stream already closed)
WRITE_ERRORS: tuple[type[Exception], ...] = (OSError, ValueError)
#: what :class:`BestEffort` calls the output lines in its reports
OUTPUT = "its output"


def _to_stderr(line: str) -> bool:
    """Write ``line`` to stderr; False when that failed too."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError, RuntimeError):  # RuntimeError: inside another write to stderr (a signal)
        return False
    return True


class BestEffort:
    """Writes that must not stop supervision or a stop: the output lines (``echo``) and files
    (:meth:`attempt`) of :class:`Launcher` (its supervisor's too) and of :func:`stop_run`.

    A write that raises one of :data:`WRITE_ERRORS` is dropped. Each kind of write (``what``)
    that fails is reported once, on stderr, or, when stderr fails too (the detached supervisor's
    is the same full disk), ahead of the next output line that can be written; it is reported
    again only after a write of that kind has worked in between.
    """

    def __init__(self, echo: Callable[[str], None]) -> None:
        self._echo = echo
        self.failing: dict[str, str] = {}   # what -> why, for the kinds of write failing now
        self._held: list[str] = []          # reports that could not be written yet

    def say(self, line: str) -> None:
        """Write one output line (after any report held back); never raises a write error."""
        try:
            while self._held:
                self._echo(self._held[0])
                self._held.pop(0)
            self._echo(line)
        except WRITE_ERRORS as exc:
            self.failed(OUTPUT, exc)
            return
        self.failing.pop(OUTPUT, None)

    def attempt(self, what: str, write: Callable[[], object]) -> bool:
        """Run ``write`` (it writes ``what``); False, reported once, when it raised a write error."""
        try:
            write()
        except WRITE_ERRORS as exc:
            self.failed(what, exc)
            return False
        if self.failing.pop(what, None) is not None:
            self.say(f"note: {what} is written again")
        return True

    def failed(self, what: str, exc: BaseException) -> None:
        """A write of ``what`` failed: report it, unless that is already done for this run of failures."""
        if what in self.failing:
            return
        why = self.failing[what] = (exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)) \
            or exc.__class__.__name__
        report = (f"warning: could not write {what}: {why}; carrying on without it (said once, until a "
                  "write of it works again)")
        if not _to_stderr(report):
            self._held.append(report)


def per_run_env(topo: Topology) -> dict[str, str]:
    """Per-run environment for every engine: the secrets the connector draws fresh for each run
    (:meth:`disagg.engines.base.EngineAdapter.run_env`; the socket connector's shared secret)."""
    return {} if topo.colocated else engine_adapter(topo.engine).run_env(topo)


def engine_key_env(topo: Topology) -> str | None:
    """The variable that carries the run's engine key into every engine (vLLM: ``VLLM_API_KEY``),
    or None where the engines cannot be guarded (SGLang; a Rust router in front)."""
    return engine_adapter(topo.engine).key_env(topo)


def run_engine_key(topo: Topology, environ: Mapping[str, str] = os.environ) -> str | None:
    """The engine key of one run: ``$DISAGG_ENGINE_KEY`` when set (operators who reach engines
    directly), else a fresh random one; None when the topology's engines are not guarded."""
    if engine_key_env(topo) is None:
        return None
    chosen = environ.get(ENGINE_KEY_ENV)
    if not chosen:
        return secrets.token_urlsafe(32)
    try:
        return check_key(chosen, ENGINE_KEY_ENV)
    except ProxyError as exc:
        raise LaunchError(str(exc)) from None


class LauncherState(enum.Enum):
    NEW = "new"
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"


@dataclass
class _Pending:
    """An engine that was started and is not yet healthy."""

    record: ProcessRecord
    started: float
    healthy_at: float | None = None
    scanned: int = 0  # bytes of its log searched for a stuck-start line (TrackedProcesses.stuck_line)


#: how often a start-up of local engines looks at them (health, exit, log): a quarter second, so
#: that `up` (and a restart) says ready within that of the engine's own readiness; remote engines
#: (an ssh command per look) keep the launcher's ``poll_interval``
STARTUP_POLL_S = 0.25


class Launcher:
    """Owns the processes of one deployment from ``up()`` until ``stop()``."""

    def __init__(self, dep: Deployment, *, echo: Callable[[str], None] | None = None,
                 poll_interval: float = 1.0) -> None:
        self.dep = dep
        self.topo = dep.topology
        #: where output lines go; callers write through :meth:`say` (best-effort), never directly
        self.echo = echo or (lambda line: print(line, flush=True))
        self.out = BestEffort(lambda line: self.echo(line))
        #: the last :meth:`save` failed: the state file lags behind (the supervisor retries each poll)
        self.unsaved = False
        self.poll_interval = poll_interval
        self.state = LauncherState.NEW
        self.run = RunState(topology=str(Path(self.topo.file).resolve()), name=self.topo.name,
                            run_dir=str(Path(self.topo.run_dir).resolve()), proxy_url=dep.proxy_url,
                            started_at=time.time(), up_pid=os.getpid())
        self.log_dir = run_path(self.run.run_dir, self.topo.name) / LOGS
        self.link: EmulatedLink | None = None
        #: the run's engine key: in every engine's and the proxy's environment, nowhere else
        self.engine_key = run_engine_key(self.topo)
        self.key_env = engine_key_env(self.topo)
        self._key_origin = f"from ${ENGINE_KEY_ENV}" if os.environ.get(ENGINE_KEY_ENV) else "generated for this run"
        self.lock = RunLock(self.run.run_dir, self.topo.name)
        self._signals = 0            # SIGINT/SIGTERM received (see interrupt())
        self._signals_at_stop = 0    # ... when the stop began: any later one hurries it
        self._interruptible = False  # inside a wait of start-up that KeyboardInterrupt may cut short
        self._raised = False         # the one KeyboardInterrupt of start-up was raised
        self._extra_env: dict[str, str] = {}  # the run's secrets, for every (re)start of an engine
        #: the started processes (liveness, exits, logs, sweeps) and their health checks
        self.processes = TrackedProcesses(dep.engines, self.topo.timeouts, self.say)
        self.health = HealthCheck(dep.engines)
        self._supervisor: Supervisor | None = None

    # -- public -----------------------------------------------------------------
    def up(self) -> RunState:
        """Start engines and proxy and wait until all are healthy.

        On any failure (or Ctrl-C) stops what was started, then re-raises.
        """
        if self.state is not LauncherState.NEW:
            raise LaunchError(f"this launcher is {self.state.value}; create a new one to start again")
        self.state = LauncherState.STARTING
        self._take_lock()
        try:
            with self._wait_point():
                self._refuse_if_running()
                self._check_ports()
        except BaseException:
            self.state = LauncherState.STOPPED
            self.release()
            raise
        try:
            with self._wait_point():
                self._open_link()  # the namespace is recorded before it is created
                self._open_cpu_shares()  # so is each cgroup
                if self.topo.model.embedded:
                    ensure_model(self.topo.model.embedded, self.topo.model.path)
            self._extra_env = {**per_run_env(self.topo), **self._engine_key_env()}
            self._say_engine_key()
            t0 = time.monotonic()
            pending = []
            for eng in self.dep.engines:
                self._check_interrupt()
                pending.append(self._start_engine(eng))
            with self._wait_point():
                self._wait_healthy(pending, t0)
            self._start_proxy()
            self.say(f"ready: {self.dep.proxy_url} (OpenAI-compatible; {len(self.dep.engines)} engines, "
                      f"up in {time.monotonic() - t0:.0f} s; logs in {self.log_dir})")
        except BaseException as exc:
            self.state = LauncherState.STOPPING
            self.say("interrupted: stopping everything that was started" if isinstance(exc, KeyboardInterrupt)
                      else "startup failed: stopping everything that was started")
            self.stop(grace=min(self.topo.timeouts.shutdown_grace, processes.ABORT_GRACE_S))
            raise
        self.state = LauncherState.RUNNING
        return self.run

    def interrupt(self) -> None:
        """Ctrl-C or SIGTERM; call it from the signal handler.

        During start-up it raises KeyboardInterrupt at once when inside a wait, or
        at the next point where nothing is being started; once stopping, it only
        makes the stop immediate (see :meth:`hurry`). Never raises twice.
        """
        self._signals += 1
        if self._interruptible:
            self._check_interrupt()

    def say(self, line: str) -> None:
        """One line of output through ``echo``, best-effort (:class:`BestEffort`): what the launcher,
        its supervisor and its stop print."""
        self.out.say(line)

    def hurry(self) -> bool:
        """True once a signal arrived after the stop began: SIGKILL what is left now."""
        return self._signals > self._signals_at_stop

    def release(self) -> None:
        """Give back the run's lock (a detached ``up`` before it returns; ``stop()`` does it too)."""
        self.lock.release()

    def supervise(self, should_stop: Callable[[], bool]) -> int:
        """Once up: watch every process until ``should_stop()``, restarting those that exit
        as the topology's ``restart`` policy says (see :mod:`disagg.launch.supervisor`).

        Returns 0 when asked to stop, 1 when the service is lost for good (the proxy or
        every decode engine exited and is not restarted).
        """
        if self._supervisor is None:
            self._supervisor = Supervisor(self)  # one for the launcher's life: restart budgets persist
        return self._supervisor.run(should_stop)

    def stop(self, *, grace: float | None = None) -> None:
        """Stop every process this launcher started (idempotent); a signal meanwhile hurries it."""
        if self.state is LauncherState.STOPPED:
            return
        self.state = LauncherState.STOPPING
        self._signals_at_stop = min(self._signals, 1)  # the Ctrl-C that asked for this stop does not hurry it
        try:
            stop_run(self.run, grace=self.topo.timeouts.shutdown_grace if grace is None else grace,
                     ssh_timeout=self.topo.timeouts.ssh_check, echo=self.say, hurry=self.hurry)
        finally:
            self.state = LauncherState.STOPPED
            self.release()

    # -- what the supervisor uses besides processes and health ------------------------
    def restart(self, rec: ProcessRecord) -> None:
        """Start the process of ``rec`` again (same command line, environment and secrets, log
        appended) and record its new pid."""
        self._append_to_log(rec, f"{OWN_LOG_LINE}restart {rec.restarts} at {time.strftime('%Y-%m-%d %H:%M:%S')}"
                                 f" after {rec.last_exit or 'an exit'} ---")
        if rec.kind == "proxy":
            new = self._spawn_proxy(fresh_log=False)
        else:
            new = self._spawn_engine(self.processes.engine(rec.name), fresh_log=False)
        rec.pid, rec.create_time, rec.start_ticks = new.pid, new.create_time, new.start_ticks
        self.processes.started_again(rec.pid)  # a pid number handed out again: not the old exit
        self.save()
        self.say(f"{rec.name}: started again (restart {rec.restarts}, pid {rec.pid})")

    def save(self) -> bool:
        """Rewrite the run-state file, best-effort (the supervisor's changes, a restart's new pid).

        False when the write failed (reported once, see :class:`BestEffort`); the file then keeps
        its previous content and :attr:`unsaved` stays True until a save works: the supervisor
        tries again at each poll."""
        path = run_path(self.run.run_dir, self.run.name) / STATE_FILE
        self.unsaved = not self.out.attempt(f"the state file {path}", lambda: save_state(self.run))
        return not self.unsaved

    def _append_to_log(self, rec: ProcessRecord, line: str) -> None:
        """A line of the launcher's own in a local process's log (best-effort)."""
        if rec.ssh:
            return  # the remote log gets the new process's output; the local supervisor log has the line

        def write() -> None:
            with open(rec.log, "a", encoding="utf-8") as fh:
                fh.write(line + "\n")
        self.out.attempt(f"the log {rec.log}", write)

    # -- interrupts and the lock -------------------------------------------------
    def _check_interrupt(self) -> None:
        """Raise the start-up's KeyboardInterrupt if a signal has arrived (once)."""
        if self._signals and not self._raised and self.state is LauncherState.STARTING:
            self._raised = True
            raise KeyboardInterrupt

    @contextmanager
    def _wait_point(self) -> Iterator[None]:
        """A stretch of start-up that starts no process: a signal cuts it short at once."""
        self._interruptible = True
        try:
            self._check_interrupt()
            yield
        finally:
            self._interruptible = False

    def _take_lock(self) -> None:
        holder = self.lock.acquire()
        if holder is not None:
            self.state = LauncherState.STOPPED
            who = f"pid {holder}" if holder else "another process"
            raise LaunchError(f"topology {self.topo.name!r} is being started or run by another `disagg up` "
                              f"({who}, holding {self.lock.path}); stop it with Ctrl-C or `disagg down "
                              f"{self.topo.file}`, or wait for it")

    # -- steps ------------------------------------------------------------------
    def _refuse_if_running(self) -> None:
        """Refuse while an earlier run of this topology has processes; remove a stale state (and its link)."""
        path = run_path(self.run.run_dir, self.topo.name) / STATE_FILE
        if not path.exists():
            return
        try:
            old = load_state(path)
        except StateError:
            path.unlink(missing_ok=True)
            return
        found = {r.name: processes.liveness(r, ssh_timeout=self.topo.timeouts.ssh_check) for r in old.processes}
        live = [f"{name} ({state.value})" for name, state in found.items()
                if state in (processes.Liveness.RUNNING, processes.Liveness.LEFTOVERS)]
        if live:
            raise LaunchError(f"topology {self.topo.name!r} is already up ({', '.join(live)}; state {path}); "
                              f"run `disagg down {self.topo.file}` first")
        unknown = [r for r in old.processes if found[r.name] is processes.Liveness.UNREACHABLE]
        if unknown:
            raise LaunchError(f"cannot tell whether topology {self.topo.name!r} is still up: "
                              + ", ".join(f"{r.name} on {r.host} ({r.ssh[-1] if r.ssh else r.address})"
                                          for r in unknown)
                              + f" did not answer over ssh; run `disagg down {self.topo.file}` once they do "
                              f"(state {path})")
        for namespace in old.namespaces:
            remove_namespace(namespace)
            self.say(f"link: removed network namespace {namespace} of an earlier run")
        for cgroup in old.cgroups:
            if cpushare.remove(cgroup):
                self.say(f"emulate: removed cgroup {cgroup} of an earlier run")
        remove_state(old)
        self.say(f"removed the stale state of an earlier run (every process had exited): {path}")

    def _check_ports(self) -> None:
        by_host: dict[str, list[tuple[int, str]]] = {}
        addresses = {h.address: h for h in self.topo.hosts.values()}
        for address, port, where in iter_ports(self.topo):
            host = addresses.get(address)
            by_host.setdefault(host.name if host else "", []).append((port, where))
        problems = []
        for host_name, ports in by_host.items():
            if host_name:
                host = self.topo.hosts[host_name]
                busy = set(busy_ports(host, python_for(host), [p for p, _ in ports],
                                      ssh_timeout=self.topo.timeouts.ssh_command))
                address = host.address
            else:  # the proxy on an address that is no topology host: this machine
                address = self.topo.proxy.host
                busy = {p for p, _ in ports if not local_port_free(address, p)}
            problems += [f"{address}:{p} ({where})" for p, where in ports if p in busy]
        if problems:
            raise PortInUseError("port already in use, nothing was started: " + ", ".join(problems)
                                 + "; stop whatever holds it (or `disagg down`) or change the topology")

    def _open_link(self) -> None:
        """Create the emulated link (namespace + shaped veth) before any engine starts."""
        if self.topo.link.type != "emulated":
            return
        self.link = emulated_link(self.topo)
        self.run.namespaces.append(self.link.a.namespace)
        save_state(self.run)
        self.link.open()
        self.say(f"link: {self.link.a.namespace} ({self.link.a.address}) <-> root namespace "
                  f"({self.link.b.address}), shaped at {self.topo.link.rate_text} with tc tbf")

    def _open_cpu_shares(self) -> None:
        """Say what each host emulates; create the cgroups of hosts with ``emulate.cpu_share``."""
        for line in emulation_lines(self.topo):
            self.say(line)
        for host in self.topo.hosts.values():
            share = cpu_share_for(self.topo, host)
            if share is None:
                continue
            path = share.path()
            if str(path) not in self.run.cgroups:
                self.run.cgroups.append(str(path))
            save_state(self.run)
            share.create()

    def _write_files(self, eng: EngineLaunch) -> None:
        """Write the engine's config files into the run directory on its host."""
        if not eng.files:
            return
        directory = host_run_dir(self.topo, eng.host)
        if eng.host.is_remote:
            script = f"mkdir -p {shlex.quote(directory)}"
            for name, text in eng.files:
                script += f" && printf %s {shlex.quote(text)} > {shlex.quote(directory + '/' + name)}"
            processes.run_remote(ssh_prefix(eng.host), script, timeout=self.topo.timeouts.ssh_command)
        else:
            Path(directory).mkdir(parents=True, exist_ok=True)
            for name, text in eng.files:
                (Path(directory) / name).write_text(text)
        self.say(f"{eng.name}: wrote {', '.join(n for n, _ in eng.files)} in {eng.host.name}:{directory}")

    def _engine_key_env(self) -> dict[str, str]:
        return {self.key_env: self.engine_key} if self.key_env and self.engine_key else {}

    def _say_engine_key(self) -> None:
        """One line naming where the key goes (variables only, never the value)."""
        if self.key_env and self.engine_key:
            self.say(f"engine key ({self._key_origin}): in {self.key_env} of every engine and {ENGINE_KEY_ENV} of the "
                      "proxy; engines answer only requests that carry it (GET /health, /metrics stay open)")
        else:
            self.say(f"engine key: none (engine {self.topo.engine}, proxy.kind {self.topo.proxy.kind}); "
                      "the engines answer anyone who reaches their ports")

    def _start_engine(self, eng: EngineLaunch) -> _Pending:
        with self._wait_point():
            self._write_files(eng)
        record = self._spawn_engine(eng, fresh_log=True)
        self.run.processes.append(record)
        save_state(self.run)
        where = f"{eng.host.name} ({eng.host.ssh})" if eng.host.is_remote else eng.host.name
        self.say(f"{eng.name}: starting on {where} at {eng.url} (pid {record.pid}, log {record.log})")
        return _Pending(record=record, started=time.monotonic())

    def _spawn_engine(self, eng: EngineLaunch, *, fresh_log: bool) -> ProcessRecord:
        """Start one engine process with the run's secrets; its record (not yet in the state)."""
        env = {**dict(eng.env), **self._extra_env}
        if eng.host.is_remote:
            log = host_log(self.topo, eng.host, eng.log_name)
            hidden = SECRET_ENVS.union(self._extra_env)
            secret = {k: v for k, v in env.items() if k in hidden}
            public = tuple(sorted((k, v) for k, v in env.items() if k not in hidden))
            shell = EngineLaunch(eng.instance, eng.host, eng.argv, public, eng.health_path, eng.files).shell_command()
            pid = processes.start_remote(eng.host, shell, log, secret_env=secret,
                                         ssh_timeout=self.topo.timeouts.ssh_command)
            return ProcessRecord(name=eng.name, kind="engine", host=eng.host.name, address=eng.host.address,
                                 port=eng.instance.port, url=eng.url, log=log, pid=pid,
                                 ssh=ssh_prefix(eng.host))
        log_path = self.log_dir / eng.log_name
        if fresh_log:
            log_path.unlink(missing_ok=True)
        argv = list(eng.argv)
        if self.link is not None and eng.host.name == emulated_prefill_host(self.topo).name:
            argv = self.link.wrap("a", argv)  # behind the shaped link
        pid, created = processes.start_local(argv, env, log_path)
        share = cpu_share_for(self.topo, eng.host)
        if share is not None:
            share.add(pid)   # before the engine starts its engine core and workers, which inherit it
        return ProcessRecord(name=eng.name, kind="engine", host=eng.host.name, address=eng.host.address,
                             port=eng.instance.port, url=eng.url, log=str(log_path), pid=pid, create_time=created,
                             start_ticks=processes.start_ticks(pid))

    def _wait_healthy(self, pending: list[_Pending], t0: float) -> None:
        deadline = t0 + self.topo.timeouts.startup
        last_note = time.monotonic()
        remote = any(p.record.ssh for p in pending)   # each look at a remote engine is an ssh command
        poll = self.poll_interval if remote else min(self.poll_interval, STARTUP_POLL_S)
        while True:
            waiting = [p for p in pending if p.healthy_at is None]
            if not waiting:
                return
            for p in waiting:
                rec = p.record
                if not self.processes.alive(rec):
                    code = processes.exit_status(rec.pid) if not rec.ssh else None
                    why = f"exited (status {code}) while starting" if code is not None else "exited while starting"
                    raise EngineStartError(rec.name, rec.address, rec.port, why, self.processes.log_tail(rec))
                if self.health.ready(rec):
                    p.healthy_at = time.monotonic()
                    self.say(f"{rec.name}: healthy after {p.healthy_at - p.started:.0f} s")
                    continue
                stuck, p.scanned = self.processes.stuck_line(rec, p.scanned)
                if stuck is not None:
                    raise EngineStartError(rec.name, rec.address, rec.port,
                                           f"will not become healthy: its log says {stuck!r}",
                                           self.processes.log_tail(rec))
            now = time.monotonic()
            if now > deadline:
                rec = next(p.record for p in pending if p.healthy_at is None)
                raise EngineStartError(rec.name, rec.address, rec.port,
                                       f"did not become healthy within {self.topo.timeouts.startup:.0f} s "
                                       "(timeouts.startup)", self.processes.log_tail(rec))
            names = ", ".join(p.record.name for p in pending if p.healthy_at is None)
            if names and now - last_note >= 15:
                self.say(f"... loading: {names} ({now - t0:.0f} s)")
                last_note = now
            time.sleep(poll)

    def _proxy_argv(self) -> list[str]:
        return frontend_argv(self.dep)

    def _proxy_env(self) -> dict[str, str]:
        # The API key and the engine key travel in the environment, never in argv (visible in ps).
        env = {API_KEY_ENV: self.topo.proxy.api_key} if self.topo.proxy.api_key else {}
        if self.engine_key:
            env[ENGINE_KEY_ENV] = self.engine_key
        return env

    def _start_proxy(self) -> None:
        record = self._spawn_proxy(fresh_log=True)
        self.run.processes.append(record)
        save_state(self.run)
        started = time.monotonic()
        with self._wait_point():
            while http_status(self.dep.proxy_url + "/health", timeout=2.0) != 200:
                if not self.processes.alive(record):
                    raise EngineStartError("proxy", record.address, record.port, "exited while starting",
                                           self.processes.log_tail(record))
                limit = self.topo.timeouts.proxy_startup
                if time.monotonic() - started > limit:
                    raise EngineStartError("proxy", record.address, record.port,
                                           f"did not report healthy within {limit:g} s (timeouts.proxy_startup)",
                                           self.processes.log_tail(record))
                time.sleep(0.2)
        self.say(f"proxy: healthy at {self.dep.proxy_url}")

    def _spawn_proxy(self, *, fresh_log: bool) -> ProcessRecord:
        """Start the proxy process; its record (not yet in the state)."""
        topo = self.topo
        log_path = self.log_dir / PROXY_LOG
        if fresh_log:
            log_path.unlink(missing_ok=True)
        pid, created = processes.start_local(self._proxy_argv(), self._proxy_env(), log_path)
        return ProcessRecord(name="proxy", kind="proxy", host="local", address=topo.proxy.host,
                             port=topo.proxy.port, url=self.dep.proxy_url, log=str(log_path), pid=pid,
                             create_time=created, start_ticks=processes.start_ticks(pid))


def _stopped_line(rec: ProcessRecord, outcome: processes.StopOutcome | None) -> str:
    if outcome is None or outcome.leader_running:
        return f"{rec.name}: stopped (pid {rec.pid})"
    if outcome.others:
        return (f"{rec.name}: its leader (pid {rec.pid}) had exited; stopped the {outcome.others} processes "
                "of its group it left behind")
    return f"{rec.name}: had already exited (pid {rec.pid})"


def _failure_line(rec: ProcessRecord, exc: BaseException) -> str:
    where = f"{rec.host} ({rec.ssh[-1]})" if rec.ssh else rec.host
    if isinstance(exc, HostUnreachableError):
        return f"{rec.name} on {where}: could not reach the host, so it may still run there: {exc}"
    return f"{rec.name} on {where}: {exc}"


def stop_run(run: RunState, *, grace: float, ssh_timeout: float, echo: Callable[[str], None],
             hurry: Callable[[], bool] | None = None) -> None:
    """Stop every process of ``run``, then remove its network namespaces and its state file.

    The proxy first, then every engine at once, each whatever state its leader
    is in (``processes.stop_process``); ``hurry()`` turning true cuts the grace
    short (a SIGKILL over ssh limited to ``ssh_timeout``, ``timeouts.ssh_check``).
    Processes that could not be stopped (their host did not answer over
    SSH, or they survived SIGKILL) are named in a LaunchError; the state file
    is then kept, listing only them, so ``disagg down`` can retry.

    Called by ``Launcher.stop`` and ``disagg down``. Every process is signalled whatever
    happens to the output: ``echo`` and the state file's rewrite or removal are best-effort
    (:class:`BestEffort`; ``down``'s stdout may be a file on the disk that filled up).
    """
    out = BestEffort(echo)
    ordered = sorted(run.processes, key=lambda r: STOP_ORDER.get(r.name.split("[")[0], 9))
    failures: list[tuple[ProcessRecord, BaseException]] = []
    fatal: BaseException | None = None   # not an Exception: raised once every wave was signalled
    waves = [[r for r in ordered if r.kind == "proxy"], [r for r in ordered if r.kind != "proxy"]]
    for wave in (w for w in waves if w):
        with ThreadPoolExecutor(max_workers=len(wave), thread_name_prefix="disagg-stop") as pool:
            futures = [(rec, pool.submit(processes.stop_process, rec, grace, hurry, ssh_timeout=ssh_timeout))
                       for rec in wave]
        for rec, future in futures:
            exc = future.exception()
            if exc is None:
                out.say(_stopped_line(rec, future.result()))
            elif isinstance(exc, Exception):
                failures.append((rec, exc))
            else:
                fatal = fatal or exc
    if fatal is not None:
        raise fatal   # the state file still lists every process
    path = run_path(run.run_dir, run.name) / STATE_FILE
    if failures:
        run.processes = [rec for rec, _ in failures]
        kept = ("the state file is kept, listing only these" if out.attempt(f"the state file {path}",
                                                                             lambda: save_state(run))
                else "the state file could not be rewritten and still lists every process")
        raise LaunchError(f"could not stop everything; {kept}, so `disagg down` can retry:\n"
                          + "\n".join(_failure_line(r, e) for r, e in failures))
    for namespace in run.namespaces:
        remove_namespace(namespace)
        out.say(f"link: removed network namespace {namespace}")
    for cgroup in run.cgroups:
        out.say(f"emulate: removed cgroup {cgroup}" if cpushare.remove(cgroup)
                else f"emulate: could not remove cgroup {cgroup} (still in use?); remove it with rmdir")
    out.attempt(f"the state file {path} (its removal)", lambda: remove_state(run))


def resolve_state(run_dir: str, topology_name: str | None, *, anywhere: bool = False,
                  topology_file: str | None = None) -> RunState:
    """The run state for a topology name, or the only one under ``run_dir``.

    ``anywhere``: also this user's live runs started from other directories
    (``disagg.launch.state.live_states``); for a named topology, the one started from
    ``topology_file`` (or of that name) when ``run_dir`` has none. NotRunningError when nothing is
    found."""
    if topology_name is not None:
        path = run_path(run_dir, topology_name) / STATE_FILE
        if anywhere and not path.exists():
            others = [load_state(p) for p in live_states(run_dir) if p.parent.name == topology_name]
            wanted = str(Path(topology_file).resolve()) if topology_file else None
            same = [r for r in others if wanted is None or r.topology == wanted] or others
            if len(same) == 1:
                return same[0]
        return load_state(path)
    found = live_states(run_dir) if anywhere else find_states(run_dir)
    if not found:
        where = f"{Path(run_dir) / 'runs'}" + (f" nor in {live_dir()}" if anywhere else "")
        raise NotRunningError(f"nothing is running: no state files under {where}")
    if len(found) > 1:
        names = ", ".join(f"{p.parent.name} ({p.parent})" for p in found)
        raise StateError(f"several topologies are up ({names}); name the topology file")
    return load_state(found[0])
