"""Supervision: restart an engine or the proxy that exits on its own, with backoff and a cap.

``disagg up`` (foreground, or the detached supervisor process that ``--detach``
leaves behind) calls :meth:`Supervisor.run` once everything is healthy. Each
poll it looks at every recorded process:

- ``running`` and exited: the exit is reported with its reason and log tail,
  what it left in its process group is stopped (``TrackedProcesses.sweep``), and the
  topology's ``restart`` policy (:class:`RestartBudget`) decides: wait
  (``backoff``) and start it again, or give up (``failed``);
- ``backoff`` and the wait is over: started again (``Supervised.restart``),
  now ``starting``;
- ``starting``: ``running`` once healthy; an exit or ``timeouts.startup``
  without health counts as another failure;
- ``running`` and alive: **liveness**, as Kubernetes' liveness probe. Its
  health check (an engine's health path answering 200; the proxy answering at
  all) is probed every ``timeouts.health_interval`` seconds, each probe
  limited to ``timeouts.health_timeout``, in a thread of its own so that a hung
  process never holds up the poll. Once every probe in a row has failed for
  ``timeouts.liveness`` seconds (at least :data:`LIVENESS_MIN_FAILURES` of
  them), the process lives but serves nothing (SIGSTOPped, deadlocked): its
  process group is SIGKILLed and it is handled as an exit (restart policy,
  backoff, cap). Whether requests go to an engine meanwhile is the proxy's own
  readiness probe's business.

The state file is rewritten at each change (``status``, ``restarts``,
``last_exit``, the new pid), which is what ``disagg status`` shows; the write
is best-effort (``Supervised.save``: a full disk does not end supervision) and
retried at each poll until it works. While a
prefill engine is away the proxy serves by local prefill; while every decode
engine is away it answers 503 with ``Retry-After``. The run is lost, and
:meth:`Supervisor.run` returns 1, only when the proxy or every decode engine
has failed for good.

What it supervises is a :class:`Supervised` (the launcher, :class:`disagg.launch.launcher.Launcher`):
its tracked processes and their health checks (:mod:`disagg.launch.tracked`), and the few
things only the launcher can do (start a process again, save the state, print a line). This
module imports neither the launcher nor anything that imports it.
"""

from __future__ import annotations

import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from disagg.errors import LaunchError
from disagg.launch.state import ProcessRecord, RunState
from disagg.launch.tracked import HealthCheck, TrackedProcesses
from disagg.topology import RestartSpec, Topology


class Supervised(Protocol):
    """What the supervisor watches and acts through (the launcher)."""

    topo: Topology
    run: RunState
    poll_interval: float
    #: the last :meth:`save` failed (the supervisor saves again at the next poll)
    unsaved: bool
    processes: TrackedProcesses
    health: HealthCheck

    def restart(self, rec: ProcessRecord) -> None:
        """Start ``rec``'s process again (same command line, environment and secrets) and record its pid."""

    def save(self) -> bool:
        """Rewrite the run-state file, best-effort; False when the write failed."""

    def say(self, line: str) -> None:
        """One line of output, best-effort."""


#: how much of the log at an exit the state file keeps for `disagg status`
EXIT_LOG_LINES = 10
EXIT_LOG_CHARS = 4000
#: the fewest failed liveness probes in a row that get a running process killed, however short
#: ``timeouts.liveness`` is: one late answer is never enough
LIVENESS_MIN_FAILURES = 2


def exit_reason(code: int | None) -> str:
    """How a process ended, from its exit code (negative: the signal that killed it; None: unknown)."""
    if code is None:
        return "exited (status unknown: not a child of this supervisor, or on a remote host)"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


@dataclass
class RestartBudget:
    """The restart policy for one process: whether to restart after an exit, and after how long.

    At most ``spec.max`` restarts within any ``spec.window`` seconds; the wait before
    the k-th restart in the window is ``backoff * 2**(k-1)``, at most ``max_backoff``.
    """

    spec: RestartSpec
    restarts: deque[float] = field(default_factory=deque)  # monotonic times of restarts in the window

    def wants_restart(self, code: int | None) -> bool:
        """Whether the policy restarts after this exit (``on-failure``: not after exit status 0)."""
        if self.spec.policy == "no":
            return False
        return self.spec.policy == "always" or code != 0

    def delay(self, now: float) -> float | None:
        """Seconds to wait before the next restart, or None once the cap is reached."""
        while self.restarts and now - self.restarts[0] > self.spec.window:
            self.restarts.popleft()
        if len(self.restarts) >= self.spec.max:
            return None
        return min(self.spec.max_backoff, self.spec.backoff * 2.0 ** len(self.restarts))

    def record(self, now: float) -> None:
        """A restart happened at ``now``."""
        self.restarts.append(now)


class _Probe:
    """One liveness probe in flight, in a daemon thread of its own: a hung process holds it
    for up to ``timeouts.health_timeout`` while the supervisor goes on polling, and it never
    keeps ``disagg up`` from exiting."""

    def __init__(self, check: Callable[[], str | None], started: float) -> None:
        self.started = started
        self.failure: str | None = None   # why it failed (None: passed); valid once done
        self._done = threading.Event()
        threading.Thread(target=self._run, args=(check,), name="disagg-liveness", daemon=True).start()

    def _run(self, check: Callable[[], str | None]) -> None:
        try:
            self.failure = check()
        except Exception as exc:  # a probe that cannot be made counts as failed, it never kills the thread silently
            self.failure = f"probe failed: {exc.__class__.__name__}: {exc}"
        finally:
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()


@dataclass
class _Watched:
    """The supervisor's view of one recorded process."""

    record: ProcessRecord
    budget: RestartBudget
    due: float = 0.0        # backoff: when to start it again
    since: float = 0.0      # starting: when it was started
    scanned: int = 0        # starting: bytes of its log searched for a stuck-start line
    probe: _Probe | None = None           # running: the liveness probe in flight
    probed: float | None = None           # running: when the last liveness probe started
    failing_since: float | None = None    # running: when the first of the failed probes in a row started
    failures: int = 0                     # running: failed liveness probes in a row

    def forget_probes(self) -> None:
        """A new process, or supervision paused: earlier probes say nothing about what comes next."""
        self.probe, self.probed, self.failing_since, self.failures = None, None, None, 0


def essential(rec: ProcessRecord) -> bool:
    """Processes without which nothing is served: the proxy and the decode (or colocated) engines."""
    return rec.kind == "proxy" or rec.name.startswith(("decode[", "both["))


class Supervisor:
    """Watches the processes of one launcher (:class:`Supervised`) and restarts those that exit."""

    def __init__(self, launcher: Supervised, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.launcher = launcher
        self.spec = launcher.topo.restart
        self.clock = clock
        self.watched = [_Watched(rec, RestartBudget(self.spec)) for rec in launcher.run.processes]

    def run(self, should_stop: Callable[[], bool]) -> int:
        """Poll until ``should_stop()`` (0) or until the service is lost for good (1).

        Called by ``Launcher.supervise`` (foreground ``disagg up``, or the detached supervisor)."""
        try:
            while not should_stop():
                if self.poll() is not None:
                    return 1
                time.sleep(self.launcher.poll_interval)
            return 0
        finally:
            for w in self.watched:
                w.forget_probes()   # probes in flight end by their timeout; their answers are not awaited

    def poll(self) -> str | None:
        """One look at every process; a message once the service is lost for good, else None."""
        changed = False
        for w in self.watched:
            rec = w.record
            if rec.status == "running" and not self.launcher.processes.alive(rec):
                self._exited(w)
                changed = True
            elif rec.status == "running":
                changed |= self._check_live(w)
            elif rec.status == "backoff" and self.clock() >= w.due:
                self._restart(w)
                changed = True
            elif rec.status == "starting":
                changed |= self._check_start(w)
        if changed or self.launcher.unsaved:
            self.launcher.save()   # best-effort: a full disk leaves the file behind, not supervision
        lost = self.lost()
        if lost is not None:
            self.launcher.say(f"error: the service is lost ({lost}); stopping")
        return lost

    def lost(self) -> str | None:
        """Why nothing can be served any more, or None."""
        failed = {w.record.name for w in self.watched if w.record.status == "failed"}
        if "proxy" in failed:
            return "the proxy failed and is not restarted"
        servers = [w.record.name for w in self.watched if essential(w.record) and w.record.kind != "proxy"]
        if servers and all(name in failed for name in servers):
            return "every decode engine failed and is not restarted"
        return None

    # -- transitions ---------------------------------------------------------------
    def _check_live(self, w: _Watched) -> bool:
        """``running`` and alive: collect a finished liveness probe, start the next one when due;
        True when it was found hung and killed (see the module docstring)."""
        rec, now = w.record, self.clock()
        timeouts = self.launcher.topo.timeouts
        probe = w.probe
        if probe is not None and probe.done:
            w.probe = None
            if probe.failure is None:
                if w.failures >= LIVENESS_MIN_FAILURES:
                    self.launcher.say(f"{rec.name}: passes its health check again after {w.failures} failed "
                                      f"probes in a row ({now - (w.failing_since or now):.0f} s)")
                w.failing_since, w.failures = None, 0
            else:
                if w.failing_since is None:
                    w.failing_since = probe.started
                w.failures += 1
                silent = now - w.failing_since
                if w.failures == LIVENESS_MIN_FAILURES:   # one late answer is not worth a line
                    self.launcher.say(f"{rec.name}: failed its health check {w.failures} times in a row "
                                      f"({probe.failure}); killed and restarted if that goes on for "
                                      f"{timeouts.liveness:g} s (timeouts.liveness)")
                if w.failures >= LIVENESS_MIN_FAILURES and silent >= timeouts.liveness:
                    return self._hung(w, silent, probe.failure)
        if w.probe is None and (w.probed is None or now - w.probed >= timeouts.health_interval):
            w.probed = now
            w.probe = _Probe(lambda: self.launcher.health.unanswered(rec, timeouts.health_timeout), now)
        return False

    def _hung(self, w: _Watched, silent: float, failure: str) -> bool:
        """``w`` lives but has failed its health check for ``timeouts.liveness``: SIGKILL its
        process group, then the restart policy decides as after an exit. True when killed."""
        rec = w.record
        if not self.launcher.processes.sweep(rec, kill=True):
            self.launcher.say(f"{rec.name}: not restarted while it may still run; trying again after another "
                              f"{self.launcher.topo.timeouts.liveness:g} s without an answer")
            w.forget_probes()
            return False
        self._exited(w, f"failed its health check for {silent:.0f} s ({w.failures} probes in a row, the last: "
                        f"{failure}) though its process ran (hung or stopped): killed with SIGKILL "
                        "(timeouts.liveness)", swept=True)
        return True

    def _exited(self, w: _Watched, why: str = "", *, swept: bool = False) -> None:
        """``w`` exited (or failed to start, or was killed as hung: ``swept``): report, sweep, then
        back off or give up."""
        rec = w.record
        w.forget_probes()
        code = None if why else self.launcher.processes.exit_code(rec)  # with a reason given it may still run
        rec.last_exit = why or exit_reason(code)
        tail = self.launcher.processes.log_tail(rec)
        rec.exit_log = "\n".join(tail.splitlines()[-EXIT_LOG_LINES:])[-EXIT_LOG_CHARS:]
        self.launcher.say(f"error: {rec.name} on {rec.address}:{rec.port} {rec.last_exit}; "
                          f"last lines of {rec.log}:\n" + tail)
        if not swept:
            self.launcher.processes.sweep(rec)
        now = self.clock()
        delay = w.budget.delay(now) if w.budget.wants_restart(code) else None
        if delay is None:
            rec.status = "failed"
            if not w.budget.wants_restart(code):
                self.launcher.say(f"{rec.name}: not restarted (restart.policy {self.spec.policy})")
            else:
                self.launcher.say(f"{rec.name}: failed for good: restarted {self.spec.max} times within "
                                   f"{self.spec.window:g} s (restart.max, restart.window); not restarted again")
            return
        rec.status = "backoff"
        w.due = now + delay
        self.launcher.say(f"{rec.name}: restarting in {delay:g} s "
                           f"(restart {len(w.budget.restarts) + 1} of at most {self.spec.max} "
                           f"within {self.spec.window:g} s)")

    def _restart(self, w: _Watched) -> None:
        rec = w.record
        w.budget.record(self.clock())
        rec.restarts += 1
        w.scanned = self.launcher.processes.log_size(rec)  # the lines of its earlier runs are not this start's
        try:
            self.launcher.restart(rec)
        except LaunchError as exc:
            self._exited(w, f"could not be started again: {exc}")
            return
        except OSError as exc:   # its log could not be opened (a full disk), the program is gone, ...
            self._exited(w, f"could not be started again: {exc.strerror or exc}")
            return
        rec.status = "starting"
        w.since = self.clock()

    def _check_start(self, w: _Watched) -> bool:
        """``starting``: True when it changed state (healthy, exited, or out of time)."""
        rec = w.record
        if not self.launcher.processes.alive(rec):
            self._exited(w)
            return True
        if self.launcher.health.ready(rec):
            rec.status = "running"
            w.forget_probes()
            self.launcher.say(f"{rec.name}: healthy again after {self.clock() - w.since:.0f} s "
                               f"(restart {rec.restarts}, pid {rec.pid})")
            return True
        stuck, w.scanned = self.launcher.processes.stuck_line(rec, w.scanned)
        if stuck is not None:
            self._exited(w, f"will not become healthy after its restart: its log says {stuck!r}")
            return True
        startup = self.launcher.topo.timeouts.startup
        if self.clock() - w.since > startup:
            self._exited(w, f"did not become healthy within {startup:g} s of its restart (timeouts.startup)")
            return True
        return False
