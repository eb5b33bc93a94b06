"""Supervision: what exits is restarted with backoff, up to the cap, and nothing of it is left.

The restart policy is tested as a pure object; the supervisor itself runs a real
``Launcher`` whose engines and proxy are stand-ins (``processes.start_local``
replaced): small HTTP servers that answer every GET with 200 on the planned
``--port`` and spawn a child into their process group, as a vLLM API server
spawns its EngineCore. Detached supervision with real engines is tested in
``tests/e2e/test_launch_supervision.py``.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from disagg.cli import main
from disagg.deployment import build_deployment
from disagg.errors import EngineStartError, TopologyError
from disagg.launch import launcher as launcher_module
from disagg.launch import processes
from disagg.launch.launcher import BestEffort, Launcher, stop_run
from disagg.launch.state import ProcessRecord, RunState, load_state
from disagg.launch.supervisor import RestartBudget, Supervisor, exit_reason
from disagg.topology import RestartSpec, load_topology
from harness.ports import free_ports
from tests.unit.launch.standins import Started, kill_all, running

#: a stand-in engine or proxy: answers every GET with 200 on argv[1], one child in its group
HTTP_STANDIN = r"""
import http.server, subprocess, sys
child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])
class Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header('Content-Length', '2'); self.end_headers(); self.wfile.write(b'ok')
    def log_message(self, *args):
        pass
print('stand-in up', child.pid, flush=True)
if sys.argv[2:] == ['stuck']:  # what vLLM prints when its NIXL handshake port is taken, then waits forever
    print("zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:1')", flush=True)
    child.wait()
http.server.ThreadingHTTPServer(('127.0.0.1', int(sys.argv[1])), Ok).serve_forever()
"""


# -- the policy ---------------------------------------------------------------------
def test_backoff_doubles_up_to_the_cap_then_gives_up() -> None:
    budget = RestartBudget(RestartSpec(max=5, window=600, backoff=1, max_backoff=8))
    delays = []
    for now in range(6):
        delay = budget.delay(float(now))
        delays.append(delay)
        if delay is not None:
            budget.record(float(now))
    assert delays == [1, 2, 4, 8, 8, None]


def test_restarts_older_than_the_window_no_longer_count() -> None:
    budget = RestartBudget(RestartSpec(max=2, window=60, backoff=1))
    budget.record(0.0)
    budget.record(10.0)
    assert budget.delay(59.0) is None     # two restarts within the last 60 s
    assert budget.delay(61.0) == 2        # the first one left the window
    assert budget.delay(71.0) == 1        # both did


@pytest.mark.parametrize(("policy", "code", "restart"), [
    ("on-failure", 1, True), ("on-failure", -9, True), ("on-failure", None, True), ("on-failure", 0, False),
    ("always", 0, True), ("no", 1, False), ("no", -9, False)])
def test_policy_decides_by_exit(policy: str, code: int | None, restart: bool) -> None:
    assert RestartBudget(RestartSpec(policy=policy)).wants_restart(code) is restart


def test_exit_reasons() -> None:
    assert exit_reason(-signal.SIGKILL) == "killed by SIGKILL"
    assert exit_reason(3) == "exit status 3"
    assert exit_reason(None).startswith("exited (status unknown")


# -- the supervisor over stand-ins -----------------------------------------------------
@pytest.fixture
def standins(monkeypatch: pytest.MonkeyPatch) -> Iterator[Started]:
    started = Started()
    real = processes.start_local

    def start_standin(argv, env, log):  # type: ignore[no-untyped-def]
        port = argv[list(argv).index("--port") + 1]
        stuck = ["stuck"] if Path(log).name in started.stuck else []
        started.stuck.discard(Path(log).name)
        pid, created = real([sys.executable, "-c", HTTP_STANDIN, port, *stuck], {}, log)
        started.pids.append(pid)
        return pid, created

    monkeypatch.setattr(processes, "start_local", start_standin)
    yield started
    kill_all(started.processes())


def _launcher(tmp_path: Path, restart: str, timeouts: str = "{startup: 30, shutdown_grace: 2}") -> Launcher:
    p, d, proxy, kv_p, kv_d = free_ports(5)
    path = tmp_path / "t.yaml"
    path.write_text(textwrap.dedent(f"""\
        model: {{path: /models/m}}
        hosts: {{local: {{address: 127.0.0.1}}}}
        roles:
          prefill: [{{port: {p}, kv_port: {kv_p}}}]
          decode: [{{port: {d}, kv_port: {kv_d}}}]
        proxy: {{port: {proxy}}}
        timeouts: {timeouts}
        restart: {restart}
        """))
    launcher = Launcher(build_deployment(load_topology(path, run_dir=str(tmp_path / "run"))), poll_interval=0.05)
    launcher.lines = []  # type: ignore[attr-defined]
    launcher.echo = launcher.lines.append  # type: ignore[attr-defined]
    return launcher


def _group(pid: int) -> list[psutil.Process]:
    """Every running process whose process group is ``pid``."""
    out = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pid and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except (OSError, psutil.Error):
            continue
    return out


def _supervise_until(launcher: Launcher, done: Callable[[], bool], timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    code = launcher.supervise(lambda: done() or time.monotonic() > deadline)
    assert done(), "\n".join(launcher.lines)  # type: ignore[attr-defined]
    return code


def _record(launcher: Launcher, name: str) -> ProcessRecord:
    return next(r for r in launcher.run.processes if r.name == name)


def _state_record(launcher: Launcher, name: str) -> ProcessRecord:
    state = load_state(Path(launcher.run.run_dir) / "runs" / launcher.topo.name / "state.json")
    return next(r for r in state.processes if r.name == name)


def test_a_sigkilled_decode_is_restarted_and_nothing_of_the_old_one_is_left(
        tmp_path: Path, standins: Started) -> None:
    launcher = _launcher(tmp_path, "{backoff: 100ms}")
    launcher.up()
    try:
        decode = _record(launcher, "decode[0]")
        old_pid = decode.pid
        assert len(_group(old_pid)) == 2  # the leader and its "EngineCore"
        os.kill(old_pid, signal.SIGKILL)
        _supervise_until(launcher, lambda: decode.status == "running" and decode.pid != old_pid)
        assert _group(old_pid) == []                      # the old group was swept
        assert len(_group(decode.pid)) == 2
        assert decode.restarts == 1 and decode.last_exit == "killed by SIGKILL"
        saved = _state_record(launcher, "decode[0]")       # what `disagg status` reads
        assert (saved.pid, saved.status, saved.restarts, saved.last_exit) == (
            decode.pid, "running", 1, "killed by SIGKILL")
        log = Path(decode.log).read_text()
        assert log.count("stand-in up") == 2 and "--- disagg up: restart 1 at " in log
        lines = launcher.lines  # type: ignore[attr-defined]
        assert any(line.startswith("error: decode[0] on 127.0.0.1:") and "killed by SIGKILL" in line
                   for line in lines)
        assert "decode[0]: stopped the 1 processes of its group it left behind" in lines
        assert any(line.startswith("decode[0]: healthy again after ") for line in lines)
    finally:
        launcher.stop(grace=1.0)
    assert running(standins.processes()) == []


def test_an_engine_whose_log_says_it_is_stuck_fails_the_start_at_once(tmp_path: Path, standins: Started) -> None:
    standins.stuck.add("decode-0.log")
    launcher = _launcher(tmp_path, "{backoff: 100ms}")   # timeouts.startup: 30 s
    t0 = time.monotonic()
    with pytest.raises(EngineStartError) as info:
        launcher.up()
    assert time.monotonic() - t0 < 15
    assert info.value.name == "decode[0]"
    assert info.value.reason == ("will not become healthy: its log says "
                                 "\"zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:1')\"")
    assert "stand-in up" in info.value.log_tail
    assert running(standins.processes()) == []


def test_a_restart_whose_log_says_it_is_stuck_is_stopped_and_restarted(tmp_path: Path, standins: Started) -> None:
    launcher = _launcher(tmp_path, "{backoff: 100ms}")
    launcher.up()
    try:
        decode = _record(launcher, "decode[0]")
        first = decode.pid
        standins.stuck.add("decode-0.log")   # its first restart is stuck, its second serves
        os.kill(first, signal.SIGKILL)
        _supervise_until(launcher, lambda: decode.restarts == 2 and decode.status == "running", timeout=20)
        lines = launcher.lines  # type: ignore[attr-defined]
        stuck = [line for line in lines if "will not become healthy after its restart" in line]
        assert len(stuck) == 1 and "Address already in use" in stuck[0], lines
        assert _group(first) == []
    finally:
        launcher.stop(grace=1.0)
    assert running(standins.processes()) == []


def test_the_proxy_is_restarted_too(tmp_path: Path, standins: Started) -> None:
    launcher = _launcher(tmp_path, "{backoff: 100ms}")
    launcher.up()
    try:
        proxy = _record(launcher, "proxy")
        old_pid = proxy.pid
        os.kill(old_pid, signal.SIGTERM)
        _supervise_until(launcher, lambda: proxy.status == "running" and proxy.pid != old_pid)
        assert proxy.restarts == 1 and proxy.last_exit == "killed by SIGTERM"
    finally:
        launcher.stop(grace=1.0)


def test_after_max_restarts_in_the_window_the_next_exit_is_final(tmp_path: Path, standins: Started) -> None:
    launcher = _launcher(tmp_path, "{max: 2, window: 10m, backoff: 50ms}")
    launcher.up()
    try:
        prefill = _record(launcher, "prefill[0]")
        for restart in (1, 2):
            old = prefill.pid
            os.kill(old, signal.SIGKILL)
            _supervise_until(launcher, lambda old=old: prefill.status == "running" and prefill.pid != old)
            assert prefill.restarts == restart
        os.kill(prefill.pid, signal.SIGKILL)
        # a prefill engine failing for good is not the end of the service: decode serves alone
        assert _supervise_until(launcher, lambda: prefill.status == "failed", timeout=10) == 0
        assert prefill.restarts == 2
        assert ("prefill[0]: failed for good: restarted 2 times within 600 s (restart.max, restart.window); "
                "not restarted again") in launcher.lines  # type: ignore[attr-defined]
        assert _state_record(launcher, "prefill[0]").status == "failed"
        decode = _record(launcher, "decode[0]")
        os.kill(decode.pid, signal.SIGKILL)  # still restarted: its own budget
        _supervise_until(launcher, lambda: decode.restarts == 1 and decode.status == "running")
    finally:
        launcher.stop(grace=1.0)
    assert running(standins.processes()) == []


def test_policy_no_loses_the_service_with_the_last_decode(tmp_path: Path, standins: Started) -> None:
    launcher = _launcher(tmp_path, "{policy: 'no'}")
    launcher.up()
    try:
        decode = _record(launcher, "decode[0]")
        os.kill(decode.pid, signal.SIGKILL)
        code = launcher.supervise(lambda: False)  # returns by itself
        assert code == 1 and decode.status == "failed" and decode.restarts == 0
        lines = launcher.lines  # type: ignore[attr-defined]
        assert "decode[0]: not restarted (restart.policy no)" in lines
        assert lines[-1] == "error: the service is lost (every decode engine failed and is not restarted); stopping"
    finally:
        launcher.stop(grace=1.0)
    assert running(standins.processes()) == []


def test_ctrl_c_during_a_backoff_stops_everything(tmp_path: Path, standins: Started) -> None:
    launcher = _launcher(tmp_path, "{backoff: 60s}")
    launcher.up()
    decode = _record(launcher, "decode[0]")
    os.kill(decode.pid, signal.SIGKILL)
    _supervise_until(launcher, lambda: decode.status == "backoff")
    launcher.stop(grace=1.0)  # what `up` does after Ctrl-C ends supervise()
    assert running(standins.processes()) == []


def test_status_shows_restarts_and_the_last_exit(tmp_path: Path, standins: Started,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    launcher = _launcher(tmp_path, "{backoff: 100ms}")
    launcher.up()
    try:
        decode = _record(launcher, "decode[0]")
        old = decode.pid
        os.kill(old, signal.SIGKILL)
        _supervise_until(launcher, lambda: decode.status == "running" and decode.pid != old)
        capsys.readouterr()
        assert main(["status", "--run-dir", launcher.run.run_dir]) == 0
        out = capsys.readouterr().out
        line = next(x for x in out.splitlines() if x.strip().startswith("decode[0]"))
        assert f"pid {decode.pid}" in line and "healthy" in line
        assert "restarts 1, last exit: killed by SIGKILL" in line
        after = out.split(line + "\n", 1)[1].splitlines()
        assert after[0] == "    last lines of its log when it exited (killed by SIGKILL):"
        assert after[1].startswith("      stand-in up ")  # the old process's own output
        assert f"supervisor  pid {os.getpid()}" in out  # this test's launcher holds the run's lock
    finally:
        launcher.stop(grace=1.0)


# -- liveness: a process that lives but no longer answers ------------------------------
#: short liveness settings for the stand-ins: a probe every 0.2 s, 0.5 s each, killed after 2 s
FAST_LIVENESS = "{startup: 30, shutdown_grace: 2, health_interval: 0.2, health_timeout: 0.5, liveness: 2}"


def test_timeouts_liveness_is_a_duration_of_30_s_by_default(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    base = "model: {path: /models/m}\nhosts: {local: {address: 127.0.0.1}}\nroles: {both: [{port: 8100}]}\n"
    path.write_text(base)
    assert load_topology(path).timeouts.liveness == 30.0
    for given, seconds in (("45", 45.0), ("2m", 120.0), ("500ms", 0.5)):
        path.write_text(base + f"timeouts: {{liveness: {given}}}\n")
        assert load_topology(path).timeouts.liveness == seconds
    for bad in ("0", "-1", "soon", "true"):
        path.write_text(base + f"timeouts: {{liveness: {bad}}}\n")
        with pytest.raises(TopologyError, match=r"timeouts\.liveness: expected a duration"):
            load_topology(path)


def _until_hung_one_is_back(launcher: Launcher, rec: ProcessRecord, timeout: float) -> tuple[float, float]:
    """SIGSTOP ``rec``'s leader (hung: alive, /health unanswered), supervise until it has been
    killed and its restart is healthy; (seconds until the kill, seconds until healthy again)."""
    old = rec.pid
    stopped = time.monotonic()
    os.kill(old, signal.SIGSTOP)
    killed: list[float] = []

    def back() -> bool:
        if not killed and rec.pid != old:
            killed.append(time.monotonic() - stopped)   # restarted: the old one was killed before
        elif not killed and rec.status == "backoff":
            killed.append(time.monotonic() - stopped)
        return rec.status == "running" and rec.pid != old

    _supervise_until(launcher, back, timeout=timeout)
    return killed[0], time.monotonic() - stopped


def test_a_hung_decode_is_killed_and_restarted_after_timeouts_liveness(tmp_path: Path, standins: Started) -> None:
    launcher = _launcher(tmp_path, "{backoff: 100ms}", FAST_LIVENESS)
    launcher.up()
    try:
        decode, prefill, proxy = (_record(launcher, n) for n in ("decode[0]", "prefill[0]", "proxy"))
        old = decode.pid
        killed, back = _until_hung_one_is_back(launcher, decode, timeout=20)
        print(f"\nSIGSTOPped stand-in decode (liveness 2 s, probes 0.2 s / 0.5 s): killed after {killed:.2f} s, "
              f"healthy again after {back:.2f} s")
        assert 2.0 <= killed < 2.0 + 3.0            # not before timeouts.liveness; soon after it
        assert _group(old) == []                    # the stopped leader and its child: SIGKILLed
        assert decode.restarts == 1 and "(hung or stopped): killed with SIGKILL (timeouts.liveness)" in decode.last_exit
        assert "GET /health: no answer within 0.5 s" in decode.last_exit
        assert _state_record(launcher, "decode[0]").last_exit == decode.last_exit
        assert prefill.restarts == 0 and proxy.restarts == 0   # the healthy ones are left alone
        lines = launcher.lines  # type: ignore[attr-defined]
        assert any(line.startswith("decode[0]: failed its health check 2 times in a row (GET /health: no answer")
                   for line in lines), lines
        assert any(line.startswith("decode[0]: healthy again after ") for line in lines)
    finally:
        launcher.stop(grace=1.0)
    assert running(standins.processes()) == []


def test_a_hung_proxy_is_restarted_too(tmp_path: Path, standins: Started) -> None:
    launcher = _launcher(tmp_path, "{backoff: 100ms}", FAST_LIVENESS)
    launcher.up()
    try:
        proxy = _record(launcher, "proxy")
        _until_hung_one_is_back(launcher, proxy, timeout=20)
        assert proxy.restarts == 1 and "timeouts.liveness" in proxy.last_exit
    finally:
        launcher.stop(grace=1.0)
    assert running(standins.processes()) == []


def test_a_pause_shorter_than_timeouts_liveness_is_no_reason_to_restart(tmp_path: Path, standins: Started) -> None:
    """An engine that misses a few probes (a long prefill on a loaded machine) and answers
    again within ``timeouts.liveness`` keeps running."""
    launcher = _launcher(tmp_path, "{backoff: 100ms}", FAST_LIVENESS)
    launcher.up()
    try:
        decode = _record(launcher, "decode[0]")
        pid = decode.pid
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        launcher.supervise(lambda: time.monotonic() - t0 > 1.2)   # about 2 failed probes
        os.kill(pid, signal.SIGCONT)
        t = launcher.topo.timeouts   # had the probes gone on failing, the kill came by t0 + this:
        past = t.liveness + t.health_timeout + t.health_interval + 0.5
        launcher.supervise(lambda: time.monotonic() - t0 > past)   # past liveness, answering again
        assert (decode.pid, decode.status, decode.restarts) == (pid, "running", 0)
    finally:
        launcher.stop(grace=1.0)
    assert running(standins.processes()) == []


@pytest.mark.slow
def test_with_the_default_settings_a_hung_decode_is_restarted_after_30_to_40_s(
        tmp_path: Path, standins: Started) -> None:
    """The defaults (a probe every 2 s, 5 s each, timeouts.liveness 30 s) as shipped: killed
    no sooner than 30 s after it stopped answering, back within 40 s. In real time (``make test``
    only); the same arithmetic in virtual time runs in both tiers (the test below)."""
    launcher = _launcher(tmp_path, "{}")
    launcher.poll_interval = 1.0   # disagg up's own
    t = launcher.topo.timeouts
    assert (t.health_interval, t.health_timeout, t.liveness) == (2.0, 5.0, 30.0)
    launcher.up()
    try:
        decode = _record(launcher, "decode[0]")
        killed, back = _until_hung_one_is_back(launcher, decode, timeout=60)
        print(f"\nSIGSTOPped stand-in decode (defaults): killed after {killed:.1f} s, healthy again after {back:.1f} s")
        assert 30.0 <= killed and back < 40.0
        assert _record(launcher, "prefill[0]").restarts == 0
    finally:
        launcher.stop(grace=1.0)
    assert running(standins.processes()) == []


class VirtualClock:
    """The supervisor's clock, moved only by the test; a probe of a hung process ends when the
    clock has moved past its timeout, as a real probe's socket timeout would."""

    def __init__(self) -> None:
        self.now = 0.0
        self._moved = threading.Condition()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        with self._moved:
            self.now += seconds
            self._moved.notify_all()

    def wait_until(self, t: float) -> None:
        with self._moved:
            self._moved.wait_for(lambda: self.now >= t, timeout=30)


class VirtualEngines:
    """What the supervisor acts through (``Supervised``, its ``processes`` and ``health``), for
    a prefill and a decode engine that live in virtual time: the decode engine hangs at
    ``hung_at`` (alive, its health check unanswered); a restart starts one that answers."""

    def __init__(self, topo: Any, clock: VirtualClock, hung_at: float) -> None:
        self.topo, self.clock, self.hung_at = topo, clock, hung_at
        self.supervisor: Any = None   # the Supervisor watching these
        self.poll_interval = 1.0    # disagg up's own
        self.unsaved = False
        self.processes = self.health = self
        self.lines: list[str] = []
        self.killed: set[int] = set()
        self.hung = {200}
        self.next_pid = 300
        self.run = RunState(topology="t.yaml", name="t", run_dir="/nonexistent", proxy_url="http://127.0.0.1:1",
                            started_at=0.0, up_pid=1, processes=[
                                ProcessRecord(name=name, kind="engine", host="local", address="127.0.0.1", port=1,
                                              url="http://127.0.0.1:1", log="/nonexistent.log", pid=pid)
                                for name, pid in (("prefill[0]", 100), ("decode[0]", 200))])

    # Supervised
    def restart(self, rec: ProcessRecord) -> None:
        rec.pid, self.next_pid = self.next_pid, self.next_pid + 1

    def save(self) -> bool:
        return True

    def say(self, line: str) -> None:
        self.lines.append(line)

    # TrackedProcesses
    def alive(self, rec: ProcessRecord) -> bool:
        return rec.pid not in self.killed

    def exit_code(self, rec: ProcessRecord) -> int | None:
        return None

    def sweep(self, rec: ProcessRecord, *, kill: bool = False) -> bool:
        self.killed.add(rec.pid)
        return True

    def log_tail(self, rec: ProcessRecord) -> str:
        return ""

    def log_size(self, rec: ProcessRecord) -> int:
        return 0

    def stuck_line(self, rec: ProcessRecord, scanned: int) -> tuple[str | None, int]:
        return None, scanned

    # HealthCheck
    def answers(self, pid: int, started: float) -> bool:
        """Whether a probe of ``pid`` started at ``started`` is answered (at once)."""
        return pid not in self.hung or started < self.hung_at

    def ready(self, rec: ProcessRecord) -> bool:
        return self.answers(rec.pid, self.clock.now)

    def unanswered(self, rec: ProcessRecord, timeout: float) -> str | None:
        # when the supervisor started this probe (set before its thread starts: the clock may have
        # moved on by the time the thread runs)
        started = next(w.probed for w in self.supervisor.watched if w.record is rec)
        assert started is not None
        if self.answers(rec.pid, started):
            return None
        self.clock.wait_until(started + timeout)
        return f"GET /health: no answer within {timeout:g} s"

    def settle(self, supervisor: Any) -> None:
        """Wait (real time) for every probe in flight whose answer is due by now to be done."""
        for w in supervisor.watched:
            probe = w.probe
            if probe is None:
                continue
            due = self.answers(w.record.pid, probe.started) or \
                probe.started + self.topo.timeouts.health_timeout <= self.clock.now
            deadline = time.monotonic() + 10
            while due and not probe.done:
                assert time.monotonic() < deadline, "a probe's thread did not end"
                time.sleep(0.001)


@pytest.mark.parametrize("hung_at", [0.0, 0.5, 1.0, 1.7, 2.0, 3.2])
def test_with_the_default_settings_a_hung_decode_is_restarted_after_30_to_40_s_in_virtual_time(
        tmp_path: Path, hung_at: float) -> None:
    """The shipped defaults (a probe every 2 s, 5 s each, timeouts.liveness 30 s, restart.backoff
    1 s, disagg up's poll every second) through the supervisor on a virtual clock, the engine
    hanging at any point of the probe cycle: killed no sooner than 30 s after it stopped
    answering (and within one probe interval and one poll of that), back within 40 s."""
    path = tmp_path / "t.yaml"
    path.write_text("model: {path: /models/m}\nhosts: {local: {address: 127.0.0.1}}\n"
                    "roles: {prefill: [{port: 8100}], decode: [{port: 8200}]}\n")
    topo = load_topology(path)
    t = topo.timeouts
    assert (t.health_interval, t.health_timeout, t.liveness, topo.restart.backoff) == (2.0, 5.0, 30.0, 1.0)
    clock = VirtualClock()
    engines = VirtualEngines(topo, clock, hung_at)
    supervisor = engines.supervisor = Supervisor(engines, clock=clock)  # type: ignore[arg-type]
    prefill, decode = engines.run.processes
    killed: float | None = None
    try:
        while not (decode.status == "running" and decode.pid != 200):   # Supervisor.run in virtual time
            assert clock.now < 60, engines.lines
            engines.settle(supervisor)
            assert supervisor.poll() is None
            if killed is None and decode.status != "running":
                killed = clock.now
            clock.advance(engines.poll_interval)
        back = clock.now - engines.poll_interval
    finally:
        clock.advance(3600)   # ends the probes still waiting
    assert killed is not None
    assert 30.0 <= killed - hung_at < 30.0 + t.health_interval + engines.poll_interval, (killed, engines.lines)
    assert back - hung_at < 40.0, (back, engines.lines)
    assert decode.restarts == 1 and "(hung or stopped): killed with SIGKILL (timeouts.liveness)" in decode.last_exit
    assert "GET /health: no answer within 5 s" in decode.last_exit
    assert prefill.restarts == 0 and prefill.status == "running"
    assert any(line.startswith("decode[0]: failed its health check 2 times in a row") for line in engines.lines)
    assert any(line.startswith("decode[0]: healthy again after ") for line in engines.lines)


# -- a full disk: best-effort writes -------------------------------------------------
class FullDisk:
    """ENOSPC for every write the launcher makes of its own while ``full``: its output lines
    (``echo``: the detached supervisor's go to supervisor.log), stderr, the state file
    (``Path.write_text`` under the run directory) and the lines it appends to engine logs
    (``open`` for writing in ``disagg.launch.launcher``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, launcher: Launcher) -> None:
        self.full = False
        self.run_dir = Path(launcher.run.run_dir)
        self.lines: list[str] = launcher.lines  # type: ignore[attr-defined]
        self.stderr: list[str] = []
        launcher.echo = self.echo  # type: ignore[method-assign]
        write_text, real_open = Path.write_text, open

        def fake_write_text(path: Path, *args: Any, **kwargs: Any) -> int:
            self.check(path)
            return write_text(path, *args, **kwargs)

        def fake_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            if set(mode) & set("wax+"):
                self.check(Path(file))
            return real_open(file, mode, *args, **kwargs)

        monkeypatch.setattr(Path, "write_text", fake_write_text)
        monkeypatch.setattr(launcher_module, "open", fake_open, raising=False)
        monkeypatch.setattr(sys, "stderr", self)

    def check(self, path: Path) -> None:
        if self.full and path.resolve().is_relative_to(self.run_dir):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    def echo(self, line: str) -> None:
        if self.full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.lines.append(line)

    def write(self, text: str) -> int:   # sys.stderr
        if self.full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.stderr.append(text)
        return len(text)

    def flush(self) -> None:
        if self.full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_stops_neither_supervision_nor_the_stop(tmp_path: Path, standins: Started,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    launcher = _launcher(tmp_path, "{backoff: 100ms}")
    launcher.up()
    disk = FullDisk(monkeypatch, launcher)
    state_file = Path(launcher.run.run_dir) / "runs" / launcher.topo.name / "state.json"
    try:
        decode = _record(launcher, "decode[0]")
        old, said = decode.pid, len(disk.lines)
        disk.full = True
        os.kill(old, signal.SIGKILL)
        _supervise_until(launcher, lambda: decode.status == "running" and decode.pid != old)
        assert decode.restarts == 1 and _group(old) == []   # supervision went on: swept, restarted, healthy
        assert _state_record(launcher, "decode[0]").pid == old   # the state file could not follow ...
        assert launcher.unsaved and not state_file.with_suffix(".tmp").exists()
        assert disk.lines[said:] == [] and disk.stderr == []  # ... and nothing could be said

        disk.full = False                                    # space again: the next poll catches up
        _supervise_until(launcher, lambda: not launcher.unsaved, timeout=5)
        saved = _state_record(launcher, "decode[0]")
        assert (saved.pid, saved.status, saved.restarts) == (decode.pid, "running", 1)
        reports = [line for line in disk.lines[said:] if line.startswith("warning: could not write ")]
        assert len(reports) == 3, reports                    # each kind of write once, however often it failed
        assert all("No space left on device; carrying on without it" in r for r in reports)
        assert reports[0].startswith("warning: could not write its output: ")
        assert reports[1].startswith(f"warning: could not write the state file {state_file}: ")
        assert reports[2].startswith(f"warning: could not write the log {decode.log}: ")
        assert f"note: the state file {state_file} is written again" in disk.lines

        disk.full = True                                     # full again for the stop
        launcher.stop(grace=1.0)
    finally:
        disk.full = False
        launcher.stop(grace=1.0)
    assert running(standins.processes()) == []               # every stand-in, the proxy and both engines
    assert not state_file.exists()


def test_a_stop_whose_output_fails_still_stops_every_process(tmp_path: Path, standins: Started) -> None:
    """What `disagg down` does (its stdout a file on the disk that filled up): before, the
    ENOSPC of the line about the proxy ended the stop, and the engines kept running."""
    launcher = _launcher(tmp_path, "{backoff: 100ms}")
    launcher.up()
    assert standins.pids and len(running(standins.processes())) == 6   # 3 stand-ins with a child each
    tried: list[str] = []

    def full(line: str) -> None:
        tried.append(line)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    try:
        stop_run(launcher.run, grace=1.0, ssh_timeout=5.0, echo=full)
    finally:
        launcher.release()   # what is left, if anything, the fixture kills after the check below
    assert running(standins.processes()) == []
    assert tried[0].startswith("proxy: stopped") and len([t for t in tried if ": stopped" in t]) == 3


def test_best_effort_reports_each_failing_write_once_until_it_works_again(
        capsys: pytest.CaptureFixture[str]) -> None:
    out: list[str] = []
    full = [True]

    def echo(line: str) -> None:
        if full[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        out.append(line)

    effort = BestEffort(echo)

    def failing() -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    for _ in range(3):
        effort.say("a line")
        assert effort.attempt("the state file", failing) is False
    err = capsys.readouterr().err.splitlines()
    assert err == ["warning: could not write its output: No space left on device; carrying on without it "
                   "(said once, until a write of it works again)",
                   "warning: could not write the state file: No space left on device; carrying on without it "
                   "(said once, until a write of it works again)"]
    full[0] = False
    assert effort.attempt("the state file", lambda: None) is True
    assert out == ["note: the state file is written again"]
    assert effort.attempt("the state file", failing) is False      # failing anew: said anew
    assert "could not write the state file" in capsys.readouterr().err


def test_best_effort_holds_a_report_stderr_cannot_take_until_a_line_can_be_written(
        monkeypatch: pytest.MonkeyPatch) -> None:
    class Full:
        def write(self, text: str) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sys, "stderr", Full())
    out: list[str] = []
    effort = BestEffort(out.append)
    effort.attempt("the log x.log", lambda: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device")))
    effort.attempt("the log x.log", lambda: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device")))
    assert out == []
    effort.say("next")
    assert out == ["warning: could not write the log x.log: No space left on device; carrying on without it "
                   "(said once, until a write of it works again)", "next"]
