"""The processes one launcher started, once started: whether each still runs, how it ended,
its log, whether it passes its health check, and stopping what an exited one left behind.

Two objects, one job each, both built by :class:`disagg.launch.launcher.Launcher` for its
deployment and used by it while starting and by the supervisor
(:mod:`disagg.launch.supervisor`, which applies the restart policy) once up:

- :class:`TrackedProcesses`: liveness, exit codes (it reaps local children and keeps their
  status), logs (tail, size, the first stuck-start line), and :meth:`~TrackedProcesses.sweep`;
- :class:`HealthCheck`: an engine's or the proxy's health answer (:meth:`~HealthCheck.unanswered`).

Neither starts a process (the launcher does, and records each in the run state) nor
imports the launcher or the supervisor.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

from disagg.deployment import EngineLaunch
from disagg.errors import LaunchError
from disagg.launch import processes
from disagg.launch.health import http_status
from disagg.launch.state import ProcessRecord
from disagg.topology import Timeouts

#: how long to wait for the exit status of a local leader seen dead: a multi-threaded process
#: killed by a signal is a zombie a while before waitpid reports it (2.4 s measured for 3 GB, 49 threads)
REAP_WAIT_S = 10.0
#: the most of a starting engine's log read per poll in search of a stuck-start line
STUCK_SCAN_BYTES = 1 << 20
#: how the lines the launcher itself writes into a process's log begin (a restart's heading)
OWN_LOG_LINE = "--- disagg up: "


class TrackedProcesses:
    """What is known of the processes of one deployment (``engines``; the proxy is the record of
    kind ``proxy``), with the topology's ``timeouts``; ``say`` reports what a sweep did."""

    def __init__(self, engines: Sequence[EngineLaunch], timeouts: Timeouts, say: Callable[[str], None]) -> None:
        self._engines = {e.name: e for e in engines}
        self._timeouts = timeouts
        self._say = say
        self._exit_codes: dict[int, int] = {}  # pid -> exit code of reaped local children

    def engine(self, name: str) -> EngineLaunch:
        """The launch of engine ``name``."""
        return self._engines[name]

    def alive(self, rec: ProcessRecord) -> bool:
        """False once the recorded leader has exited (a local child is reaped, its status kept
        for :meth:`exit_code`); a remote host that does not answer counts as alive."""
        if not rec.ssh and rec.pid not in self._exit_codes:
            code = processes.exit_status(rec.pid)
            if code is not None:
                self._exit_codes[rec.pid] = code
        if rec.pid in self._exit_codes:
            return False
        return processes.is_alive(rec, ssh_timeout=self._timeouts.ssh_check)

    def exit_code(self, rec: ProcessRecord) -> int | None:
        """The exit code of an exited local leader this process started (negative: a signal), else None.

        A leader can be seen dead (a zombie) a while before ``waitpid`` reports it: wait up
        to :data:`REAP_WAIT_S` for the status."""
        if rec.ssh or rec.pid in self._exit_codes:
            return self._exit_codes.get(rec.pid)
        deadline = time.monotonic() + REAP_WAIT_S
        while True:
            try:
                waited, status = os.waitpid(rec.pid, os.WNOHANG)
            except ChildProcessError:
                return None  # not a child of this process (or reaped elsewhere): unknown
            if waited:
                code = self._exit_codes[rec.pid] = os.waitstatus_to_exitcode(status)
                return code
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def started_again(self, pid: int) -> None:
        """``pid`` is a new process's (a restart): an exit recorded under that number is not its own."""
        self._exit_codes.pop(pid, None)

    def sweep(self, dead: ProcessRecord, *, kill: bool = False) -> bool:
        """Stop what an exited leader left in its group (a SIGKILLed API server's EngineCore and workers),
        or the whole process when it still runs (a restart that never became healthy); ``kill``:
        SIGKILL at once, no grace (a process that stopped answering, see the supervisor's liveness).

        False when it could not be stopped (its host does not answer over ssh, or something
        survived SIGKILL)."""
        grace = 0.0 if kill else min(self._timeouts.shutdown_grace, processes.ABORT_GRACE_S)
        try:
            outcome = processes.stop_process(dead, grace, ssh_timeout=self._timeouts.ssh_check)
        except LaunchError as exc:
            self._say(f"{dead.name}: could not stop {'it' if kill else 'what it left behind'}: {exc}")
            return False
        if outcome is not None and outcome.others and not outcome.leader_running:
            self._say(f"{dead.name}: stopped the {outcome.others} processes of its group it left behind")
        return True

    def log_tail(self, rec: ProcessRecord) -> str:
        """The last lines of a process's log."""
        return processes.log_tail(rec, ssh_timeout=self._timeouts.ssh_check)

    def log_size(self, rec: ProcessRecord) -> int:
        """Bytes in a local process's log now (0 for a remote one or a log not yet written): where
        :meth:`stuck_line` starts after a restart appends to the log."""
        if rec.ssh:
            return 0
        try:
            return os.path.getsize(rec.log)
        except OSError:
            return 0

    def stuck_line(self, rec: ProcessRecord, scanned: int) -> tuple[str | None, int]:
        """The first line of a starting local engine's log past byte ``scanned`` that holds one of
        its adapter's ``stuck_start_lines`` (None if none), and the byte to scan from next.

        Called by the launcher and the supervisor while an engine starts, so that an engine that
        will never be healthy is reported at once instead of after ``timeouts.startup``. Remote
        logs are not read (an SSH round trip per poll)."""
        markers = () if rec.kind != "engine" else self.engine(rec.name).stuck_start_lines
        if rec.ssh or not markers:
            return None, scanned
        try:
            with open(rec.log, "rb") as fh:
                fh.seek(scanned)
                chunk = fh.read(STUCK_SCAN_BYTES)
        except OSError:
            return None, scanned
        end = chunk.rfind(b"\n") + 1  # whole lines only; a partial last line is read again
        for line in chunk[:end].decode(errors="replace").splitlines():
            if not line.startswith(OWN_LOG_LINE) and any(m in line for m in markers):
                return line.strip(), scanned + end
        return None, scanned + (end if end or len(chunk) < STUCK_SCAN_BYTES else len(chunk))


class HealthCheck:
    """Whether the processes of one deployment (``engines``, and the proxy) pass their health check."""

    def __init__(self, engines: Sequence[EngineLaunch]) -> None:
        self._paths = {e.name: e.health_path for e in engines}

    def path(self, rec: ProcessRecord) -> str:
        """The path ``rec`` answers its health check on."""
        return "/health" if rec.kind == "proxy" else self._paths[rec.name]

    def ready(self, rec: ProcessRecord, timeout: float = 2.0) -> bool:
        """An engine answers its health path with 200; the proxy answers at all (its /health
        is 503 while an engine it needs is away)."""
        return self.unanswered(rec, timeout) is None

    def unanswered(self, rec: ProcessRecord, timeout: float) -> str | None:
        """Why ``rec`` fails its health check within ``timeout`` s (None: it passes, see :meth:`ready`).

        The supervisor's liveness probe calls it from a thread of its own."""
        path = self.path(rec)
        code = http_status(rec.url + path, timeout=timeout)
        if code is None:
            return f"GET {path}: no answer within {timeout:g} s"
        if rec.kind != "proxy" and code != 200:
            return f"GET {path} answered {code}"
        return None
