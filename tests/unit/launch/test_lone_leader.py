"""An engine's leader that loses its SIGTERM is sent it again once it is the last of its group
running, so stopping returns when everything has exited, not after the whole grace; what is
busy shutting down keeps the grace, and the proxy (whose second SIGTERM stops its drain) gets one.

The leader is a stand-in for vLLM's API server during start-up (no engines here): its first
SIGTERM is lost (vLLM swallows the KeyboardInterrupt it raises while waiting for its EngineCore's
handshake), a second one makes it exit. Its children stand in for the EngineCore (dies on
SIGTERM, or takes a while) and for multiprocessing's resource tracker (ignores SIGTERM, exits
when the leader does)."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import psutil
import pytest

from disagg.launch import processes
from disagg.launch.state import ProcessRecord
from tests.unit.launch.standins import kill_all, running
from tests.waiting import wait_until

#: stand-in API server; argv[1]: seconds its stand-in EngineCore takes to exit after SIGTERM (0: at once)
STANDIN_API_SERVER = r"""
import signal, subprocess, sys, time
core = ('import signal, sys, time\n'
        'def stop(*_):\n'
        '    time.sleep(float(sys.argv[1]))\n'
        '    print(f"core: exited at {time.monotonic():.3f}", flush=True)\n'
        '    sys.exit(0)\n'
        'signal.signal(signal.SIGTERM, stop)\n'
        'print("core up", file=sys.stderr, flush=True)\n'
        'time.sleep(600)\n')
tracker = ('import signal, sys\n'
           'signal.signal(signal.SIGTERM, signal.SIG_IGN)\n'
           'print("tracker up", file=sys.stderr, flush=True)\n'
           'sys.stdin.read()\n')
terms = 0
def on_term(*_):
    global terms
    terms += 1
    print(f"leader: SIGTERM {terms} at {time.monotonic():.3f}", flush=True)
    if terms > 1:
        sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
kids = [subprocess.Popen([sys.executable, '-c', tracker], stdin=subprocess.PIPE, stderr=subprocess.PIPE),
        subprocess.Popen([sys.executable, '-c', core, sys.argv[1]], stderr=subprocess.PIPE)]
for kid in kids:
    print(kid.stderr.readline().decode().strip(), flush=True)   # up, its SIGTERM disposition set
print("leader up", flush=True)
while True:
    time.sleep(600)
"""


def _start(tmp_path: Path, core_exit_s: float, kind: str = "engine") -> tuple[ProcessRecord, list[psutil.Process]]:
    log = tmp_path / "standin.log"
    pid, created = processes.start_local([sys.executable, "-c", STANDIN_API_SERVER, str(core_exit_s)], {}, log)
    rec = ProcessRecord(name="prefill[0]" if kind == "engine" else "proxy", kind=kind, host="local",
                        address="127.0.0.1", port=1, url="http://127.0.0.1:1", log=str(log), pid=pid,
                        create_time=created, start_ticks=processes.start_ticks(pid))
    wait_until(lambda: "leader up" in log.read_text(), 30, "the stand-in API server up")
    leader = psutil.Process(pid)
    return rec, [leader, *leader.children(recursive=True)]


def _terms(rec: ProcessRecord) -> list[float]:
    """When the stand-in leader got each SIGTERM (CLOCK_MONOTONIC, shared by all processes)."""
    return [float(t) for t in re.findall(r"leader: SIGTERM \d+ at ([\d.]+)", Path(rec.log).read_text())]


def test_the_tracker_stand_in_ignores_sigterm_and_the_core_does_not(tmp_path: Path) -> None:
    rec, tree = _start(tmp_path, 0.0)
    try:
        ignoring = {"SIG_IGN" in " ".join(p.cmdline()): processes.ignores_sigterm(p.pid) for p in tree[1:]}
        assert ignoring == {True: True, False: False} and not processes.ignores_sigterm(rec.pid)
        assert not processes.ignores_sigterm(2 ** 22 + 1)   # no such process
    finally:
        kill_all(tree)


def test_a_leader_that_lost_its_sigterm_gets_it_again_once_alone(tmp_path: Path) -> None:
    """Measured with the real vLLM API server loading: `down` waited the whole 20 s grace."""
    rec, tree = _start(tmp_path, 0.0)
    try:
        started = time.monotonic()
        outcome = processes.stop_local(rec, grace=60.0)
        took = time.monotonic() - started
        print(f"stopped in {took:.2f} s")
        assert outcome == processes.StopOutcome(leader_running=True, others=2)
        assert took < processes.LONE_LEADER_S + 4
        assert len(_terms(rec)) == 2
        wait_until(lambda: running(tree) == [], 5, "the leader and both children gone")
    finally:
        kill_all(tree)


def test_a_leader_whose_group_is_busy_shutting_down_is_left_to_wait(tmp_path: Path) -> None:
    """The stand-in EngineCore takes 3 s to exit: its leader gets no second SIGTERM before that."""
    rec, tree = _start(tmp_path, 3.0)
    try:
        started = time.monotonic()
        processes.stop_local(rec, grace=60.0)
        took = time.monotonic() - started
        print(f"stopped in {took:.2f} s")
        core_exit = float(re.findall(r"core: exited at ([\d.]+)", Path(rec.log).read_text())[0])
        first, second = _terms(rec)
        # the stand-ins stamp their own clocks: the core's receipt of the group's SIGTERM may come
        # a few ms before the leader's handler stamps its own
        assert core_exit - first >= 3.0 - 0.1
        assert second - core_exit >= processes.LONE_LEADER_S * 0.9
        assert 3.0 <= took < 3.0 + processes.LONE_LEADER_S + 4
        wait_until(lambda: running(tree) == [], 5, "the leader and both children gone")
    finally:
        kill_all(tree)


def test_the_proxy_gets_one_sigterm(tmp_path: Path) -> None:
    """A second SIGTERM stops the proxy's drain: it is never repeated, the grace is waited out."""
    rec, tree = _start(tmp_path, 0.0, kind="proxy")
    try:
        started = time.monotonic()
        processes.stop_local(rec, grace=2.0)
        assert time.monotonic() - started >= 2.0
        assert len(_terms(rec)) == 1
        wait_until(lambda: running(tree) == [], 5, "the leader and both children gone")
    finally:
        kill_all(tree)


@pytest.mark.parametrize("lone", [True, False], ids=["engine", "proxy"])
def test_remote_stop_sends_a_lone_engine_leader_sigterm_again(tmp_path: Path, lone: bool) -> None:
    """The same on a remote host (`sh -c` stands in for ssh, so the stop script runs here)."""
    rec, tree = _start(tmp_path, 0.0, kind="engine" if lone else "proxy")
    remote = ProcessRecord(**{**rec.__dict__, "create_time": 0.0, "start_ticks": 0, "ssh": ["sh", "-c"]})
    try:
        started = time.monotonic()
        outcome = processes.stop_remote(remote, grace=4.0)
        took = time.monotonic() - started
        assert outcome.leader_running and outcome.others == 2
        if lone:
            assert took < processes.LONE_LEADER_S + 3 and len(_terms(rec)) == 2
        else:
            assert took >= 4.0 and len(_terms(rec)) == 1
        processes.exit_status(rec.pid)   # reap our child, as init would on the remote host
        wait_until(lambda: running(tree) == [], 5, "the leader and both children gone")
    finally:
        kill_all(tree)
