"""Process groups: start, liveness, log tail, stop (TERM then KILL) with grandchildren."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import psutil

from disagg.launch import processes
from disagg.launch.state import ProcessRecord

# A parent that spawns a child which ignores SIGTERM: stop must still remove both.
STUBBORN = (
    "import os, signal, subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', "
    "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(\"child up\", flush=True); "
    "time.sleep(300)'])\n"
    "print('parent up', child.pid, flush=True)\n"
    "time.sleep(300)\n"
)


def _record(pid: int, created: float, log: Path) -> ProcessRecord:
    return ProcessRecord(name="x[0]", kind="engine", host="local", address="127.0.0.1", port=1, url="http://x",
                         log=str(log), pid=pid, create_time=created)


def _wait_for(log: Path, text: str) -> None:
    deadline = time.monotonic() + 30
    while text not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline, f"{text!r} never appeared in {log}"
        time.sleep(0.05)


def test_stop_kills_the_whole_group(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    pid, created = processes.start_local([sys.executable, "-c", STUBBORN], {"FOO": "1"}, log)
    rec = _record(pid, created, log)
    _wait_for(log, "child up")
    tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    assert len(tree) == 2 and processes.is_alive(rec)
    assert "parent up" in processes.log_tail(rec)

    started = time.monotonic()
    processes.stop_local(rec, grace=1.0)
    assert time.monotonic() - started < 15
    _, alive = psutil.wait_procs(tree, timeout=5)
    assert not alive
    assert not processes.is_alive(rec)


def test_env_reaches_the_process(tmp_path: Path) -> None:
    log = tmp_path / "env.log"
    pid, created = processes.start_local([sys.executable, "-c", "import os; print('X=' + os.environ['X'])"],
                                         {"X": "42"}, log)
    psutil.Process(pid).wait(timeout=30)
    assert processes.log_tail(_record(pid, created, log)).strip() == "X=42"


def test_reused_pid_is_not_ours(tmp_path: Path) -> None:
    log = tmp_path / "y.log"
    pid, created = processes.start_local([sys.executable, "-c", "import time; time.sleep(30)"], {}, log)
    try:
        assert processes.is_alive(_record(pid, created, log))
        assert not processes.is_alive(_record(pid, created - 100.0, log))
    finally:
        processes.stop_local(_record(pid, created, log), grace=1.0)


def test_a_wall_clock_step_does_not_make_a_live_process_look_recycled(tmp_path: Path, monkeypatch) -> None:
    """psutil's create_time is ticks since boot plus the boot time as the wall clock puts it now:
    a clock step made a live engine look like a recycled pid (taken for exited, its record
    dropped, left running). Recorded with its start in ticks since boot, it stays ours, and a
    process that really took the pid over (other start ticks) is still told apart."""
    log = tmp_path / "z.log"
    pid, created = processes.start_local([sys.executable, "-c", "import time; time.sleep(30)"], {}, log)
    rec = ProcessRecord(**{**_record(pid, created, log).__dict__, "start_ticks": processes.start_ticks(pid)})
    assert rec.start_ticks > 0
    real_create_time = psutil.Process.create_time
    # the wall clock stepped 5 s: psutil's create_time (ticks since boot + the boot time as the clock
    # puts it now) moves with it
    monkeypatch.setattr(psutil.Process, "create_time", lambda self: real_create_time(self) + 5.0)
    try:
        assert psutil.Process(pid).create_time() - created > 4.0          # what fooled the old check
        assert not processes.is_alive(_record(pid, created, log))         # a record without start ticks
        assert processes.is_alive(rec) and processes.liveness(rec) is processes.Liveness.RUNNING
        assert processes.local_members(rec)[1]
        assert not processes.is_alive(ProcessRecord(**{**rec.__dict__, "start_ticks": rec.start_ticks - 1}))
        processes.stop_local(rec, grace=1.0)
        assert not processes.is_alive(rec)         # stopped (a zombie until reaped counts as gone)
    finally:
        monkeypatch.undo()
        processes.stop_local(rec, grace=1.0)


def test_state_files_of_older_versions_read_without_start_ticks(tmp_path: Path) -> None:
    from disagg.launch.state import RunState
    state = RunState(topology="t.yaml", name="t", run_dir=str(tmp_path), proxy_url="http://x", started_at=0.0,
                     up_pid=1, processes=[_record(1234, 5.0, tmp_path / "l")])
    data = state.to_json().replace('"start_ticks": 0,', "")
    assert "start_ticks" not in data
    assert RunState.from_json(data).processes[0].start_ticks == 0


def test_log_tail_limits_lines(tmp_path: Path) -> None:
    log = tmp_path / "z.log"
    log.write_text("".join(f"line {i}\n" for i in range(100)))
    tail = processes.log_tail(_record(1, 0.0, log), lines=30)
    assert tail.splitlines() == [f"line {i}" for i in range(70, 100)]


def test_missing_log_is_reported(tmp_path: Path) -> None:
    assert processes.log_tail(_record(1, 0.0, tmp_path / "none.log")).startswith("(no log at ")


def test_remote_secret_travels_on_stdin_not_on_the_command_line(tmp_path: Path, monkeypatch) -> None:
    """start_remote with a local `sh -c` standing in for ssh: the secret reaches the command's
    environment, and neither the remote script (what ssh puts on the far side's command line)
    nor the command shows it."""
    from disagg.topology import HostSpec

    sent: list[list[str]] = []
    real_run = processes.subprocess.run

    def fake_run(argv, **kwargs):
        sent.append(argv)
        return real_run(argv, **kwargs)

    monkeypatch.setattr(processes, "ssh_prefix", lambda host: ["sh", "-c"])
    monkeypatch.setattr(processes.subprocess, "run", fake_run)
    out = tmp_path / "env.txt"
    secret = "ab12" * 16
    command = f"sh -c 'printf %s \"$DISAGG_KV_SECRET\" > {out}'"
    host = HostSpec(name="far", address="198.18.5.2", ssh="user@far")
    pid = processes.start_remote(host, command, str(tmp_path / "logs" / "e.log"),
                                 secret_env={"DISAGG_KV_SECRET": secret})
    assert pid > 0
    deadline = time.monotonic() + 10
    while not (out.exists() and out.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert out.read_text() == secret
    assert sent and all(secret not in " ".join(argv) for argv in sent)
