"""Nothing of an engine is orphaned: stopping it stops its whole process group and
session and sweeps its descendants, whatever state its leader is in, locally and
(through a stand-in for ssh) remotely. Engines are stand-ins (tests/unit/launch/standins.py)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

from disagg.cli import main
from disagg.errors import HostUnreachableError
from disagg.launch import processes
from disagg.launch.processes import Liveness
from disagg.launch.state import ProcessRecord, RunState, save_state
from tests.unit.launch.standins import TREE_SIZE, kill_all, running, start_tree
from tests.waiting import wait_until


def _sigkill_leader(rec: ProcessRecord) -> None:
    os.kill(rec.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while processes.is_alive(rec):
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_a_sigkilled_leader_leaves_its_group_running_and_stop_sweeps_it(tmp_path: Path) -> None:
    rec, tree = start_tree(tmp_path)
    try:
        _sigkill_leader(rec)
        time.sleep(0.3)
        assert len(running(tree)) == TREE_SIZE - 1  # the precondition of the bug: the leader alone is gone
        assert not processes.is_alive(rec) and processes.liveness(rec) is Liveness.LEFTOVERS
        started = time.monotonic()
        outcome = processes.stop_process(rec, grace=1.0)
        assert time.monotonic() - started < 10
        assert outcome == processes.StopOutcome(leader_running=False, others=TREE_SIZE - 1)
        # what stop_process SIGKILLed may show in /proc a moment longer (seen under load)
        wait_until(lambda: running(tree) == [], 5, "the whole tree gone after stop_process")
        assert processes.liveness(rec) is Liveness.GONE
    finally:
        kill_all(tree)


def test_a_dead_leaders_group_gets_no_more_than_the_abort_grace(tmp_path: Path) -> None:
    """Nothing is served by a group whose leader (the API server) has exited, so its stubborn child
    (one ignores SIGTERM, as a loading engine core did) is SIGKILLed after ABORT_GRACE_S, not
    after the shutdown grace asked for (60 s here)."""
    rec, tree = start_tree(tmp_path)
    try:
        _sigkill_leader(rec)
        started = time.monotonic()
        processes.stop_process(rec, grace=60.0)
        assert time.monotonic() - started < processes.ABORT_GRACE_S + processes.KILL_WAIT_S
        wait_until(lambda: running(tree) == [], 5, "the whole tree gone after stop_process")
    finally:
        kill_all(tree)


def test_a_running_leader_is_stopped_with_everything_it_started(tmp_path: Path) -> None:
    rec, tree = start_tree(tmp_path)
    try:
        assert processes.liveness(rec) is Liveness.RUNNING
        outcome = processes.stop_local(rec, grace=1.0)
        assert outcome == processes.StopOutcome(leader_running=True, others=TREE_SIZE - 1)
        assert running(tree) == []
    finally:
        kill_all(tree)


def test_hurry_cuts_the_grace_short(tmp_path: Path) -> None:
    """One stand-in child ignores SIGTERM: without hurry the stop would take the whole 60 s grace."""
    rec, tree = start_tree(tmp_path)
    try:
        started = time.monotonic()
        calls = iter(range(10))
        processes.stop_local(rec, grace=60.0, hurry=lambda: next(calls, None) is None)
        assert time.monotonic() - started < 10 and running(tree) == []
    finally:
        kill_all(tree)


def test_down_sweeps_what_a_sigkilled_leader_left(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`down` sweeps a record whose leader pid is dead (it once skipped such a record)."""
    decode, decode_tree = start_tree(tmp_path, "decode[0]")
    proxy, proxy_tree = start_tree(tmp_path, "proxy")
    everything = decode_tree + proxy_tree
    try:
        save_state(RunState(topology="/t.yaml", name="t", run_dir=str(tmp_path), proxy_url="http://127.0.0.1:1",
                            started_at=time.time(), up_pid=1, processes=[decode, proxy]))
        _sigkill_leader(decode)
        assert main(["status", "--run-dir", str(tmp_path)]) == 1
        assert "leader exited; processes of its group remain" in capsys.readouterr().out
        assert main(["down", "--run-dir", str(tmp_path), "--grace", "1"]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out == [f"proxy: stopped (pid {proxy.pid})",
                       f"decode[0]: its leader (pid {decode.pid}) had exited; stopped the {TREE_SIZE - 1} "
                       "processes of its group it left behind",
                       "t: down"]
        assert running(everything) == []
        assert not (tmp_path / "runs" / "t" / "state.json").exists()
    finally:
        kill_all(everything)


def test_a_recycled_pid_is_never_signalled(tmp_path: Path) -> None:
    """A record whose pid now belongs to another process (other create time): nothing is swept."""
    rec, tree = start_tree(tmp_path)
    try:
        stale = ProcessRecord(**{**rec.__dict__, "create_time": rec.create_time - 1000.0})
        assert processes.liveness(stale) is Liveness.GONE
        assert processes.stop_local(stale, grace=0.5) == processes.StopOutcome(False, 0)
        assert len(running(tree)) == TREE_SIZE
    finally:
        processes.stop_local(rec, grace=0.5)
        kill_all(tree)


def test_a_record_naming_this_process_or_its_group_is_never_signalled(tmp_path: Path) -> None:
    for pid in {os.getpid(), os.getpgrp(), os.getsid(0)}:
        rec = ProcessRecord(name="x", kind="engine", host="local", address="127.0.0.1", port=1, url="http://x",
                            log=str(tmp_path / "x.log"), pid=pid)
        assert processes.local_members(rec) == (False, [])
        processes.stop_local(rec, grace=0.1)
    assert psutil.Process().is_running()


def _remote(rec: ProcessRecord) -> ProcessRecord:
    """The same record as if remote; `sh -c` stands in for `ssh host`, so the remote scripts run here."""
    return ProcessRecord(**{**rec.__dict__, "create_time": 0.0, "ssh": ["sh", "-c"]})


def test_remote_stop_sweeps_the_group_of_a_dead_leader(tmp_path: Path) -> None:
    rec, tree = start_tree(tmp_path)
    remote = _remote(rec)
    try:
        assert processes.liveness(remote) is Liveness.RUNNING
        _sigkill_leader(rec)
        processes.exit_status(rec.pid)  # reap our zombie, as init would on the remote host
        assert processes.liveness(remote) is Liveness.LEFTOVERS
        started = time.monotonic()
        outcome = processes.stop_remote(remote, grace=1.0)
        assert time.monotonic() - started < 15
        # the remote sweep sees the group and the session: the nested grandchild is in both
        assert outcome.leader_running is False and outcome.others == TREE_SIZE - 1
        assert running(tree) == []
        assert processes.liveness(remote) is Liveness.GONE
    finally:
        kill_all(tree)


def test_remote_stop_of_a_running_leader(tmp_path: Path) -> None:
    rec, tree = start_tree(tmp_path)
    try:
        outcome = processes.stop_remote(_remote(rec), grace=1.0)
        assert outcome == processes.StopOutcome(leader_running=True, others=TREE_SIZE - 1)
        assert running(tree) == []
    finally:
        kill_all(tree)


#: a stand-in for ssh when the host does not answer: ssh's own exit status 255
UNREACHABLE_SSH = [sys.executable, "-c",
                   "import sys; sys.stderr.write('ssh: connect to host far port 22: No route to host\\n'); "
                   "sys.exit(255)", "me@far"]


def test_an_unreachable_host_is_not_a_dead_engine(tmp_path: Path) -> None:
    rec = ProcessRecord(name="prefill[0]", kind="engine", host="far", address="10.0.0.2", port=8100,
                        url="http://10.0.0.2:8100", log="/remote/log", pid=4242, ssh=UNREACHABLE_SSH)
    assert processes.liveness(rec) is Liveness.UNREACHABLE
    assert processes.is_alive(rec)  # an outage is no proof of death
    with pytest.raises(HostUnreachableError, match="No route to host"):
        processes.stop_remote(rec, grace=1.0)


def test_down_during_an_outage_keeps_the_state_and_names_the_engines(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    far = ProcessRecord(name="prefill[0]", kind="engine", host="far", address="10.0.0.2", port=8100,
                        url="http://10.0.0.2:8100", log="/remote/log", pid=4242, ssh=UNREACHABLE_SSH)
    decode, tree = start_tree(tmp_path, "decode[0]")
    try:
        save_state(RunState(topology="/t.yaml", name="t", run_dir=str(tmp_path), proxy_url="http://127.0.0.1:1",
                            started_at=time.time(), up_pid=1, processes=[far, decode], namespaces=["disagg-x-a"]))
        assert main(["status", "--run-dir", str(tmp_path)]) == 1
        assert "unknown (host unreachable over ssh)" in capsys.readouterr().out
        assert main(["down", "--run-dir", str(tmp_path), "--grace", "1"]) == 2
        captured = capsys.readouterr()
        assert f"decode[0]: stopped (pid {decode.pid})" in captured.out  # what could be reached was stopped
        assert running(tree) == []
        assert captured.err.splitlines() == [
            "disagg: error: could not stop everything; the state file is kept, listing only these, so "
            "`disagg down` can retry:",
            "prefill[0] on far (me@far): could not reach the host, so it may still run there: me@far: ssh failed: "
            "ssh: connect to host far port 22: No route to host"]
        kept = (tmp_path / "runs" / "t" / "state.json").read_text()
        assert '"prefill[0]"' in kept and '"decode[0]"' not in kept and "disagg-x-a" in kept
    finally:
        kill_all(tree)


def test_supervise_sweeps_what_a_dead_engine_left_and_keeps_serving(tmp_path: Path) -> None:
    """Foreground `up` while serving: a SIGKILLed prefill API server is reported once, the rest of
    its group is stopped at once (not at `down`), and serving goes on."""
    import textwrap

    from disagg.deployment import build_deployment
    from disagg.launch.launcher import Launcher
    from disagg.topology import load_topology

    path = tmp_path / "s.yaml"
    path.write_text(textwrap.dedent("""\
        model: {path: /models/m}
        hosts: {a: {address: 127.0.0.1}}
        roles: {prefill: [{port: 8100}], decode: [{port: 8200}]}
        restart: {policy: "no"}
        """))
    lines: list[str] = []
    launcher = Launcher(build_deployment(load_topology(path, run_dir=str(tmp_path / "run"))), echo=lines.append,
                        poll_interval=0.05)
    trees = {}
    for name in ("prefill[0]", "decode[0]", "proxy"):
        rec, trees[name] = start_tree(tmp_path, name)
        launcher.run.processes.append(rec)
    prefill = launcher.run.processes[0]
    try:
        _sigkill_leader(prefill)
        checks = iter(range(20))
        assert launcher.supervise(lambda: next(checks, None) is None) == 0
        assert running(trees["prefill[0]"]) == []
        assert len(running(trees["decode[0]"])) == len(running(trees["proxy"])) == TREE_SIZE
        assert sum(line.startswith("error: prefill[0] on 127.0.0.1:1 killed by SIGKILL") for line in lines) == 1
        assert f"prefill[0]: stopped the {TREE_SIZE - 1} processes of its group it left behind" in lines
    finally:
        launcher.stop(grace=0.5)
        kill_all([p for tree in trees.values() for p in tree])
    assert all(running(tree) == [] for tree in trees.values())
