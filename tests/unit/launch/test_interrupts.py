"""`disagg up` under Ctrl-C at every stage of start-up, its run lock, and stale state.

Engines are stand-ins (tests/unit/launch/standins.py): `processes.start_local`
is replaced by one that starts a stand-in process tree (which never answers
/health), so start-up waits for as long as a test needs. Ctrl-C is a real
SIGINT sent to this process's main thread while `disagg up` runs in it, through
the CLI's own handler.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from disagg.cli import main
from disagg.deployment import build_deployment
from disagg.launch import launcher as launcher_mod
from disagg.launch import processes
from disagg.launch import tracked as tracked_mod
from disagg.launch.launcher import Launcher
from disagg.launch.state import ProcessRecord, RunState, lock_holder, save_state
from disagg.topology import load_topology
from harness.ports import free_ports
from tests.unit.launch.standins import ENGINE_TREE, Started, kill_all, running, start_tree

ROOT = Path(__file__).resolve().parents[3]


def _topology(tmp_path: Path, *, model: str = "./m", grace: float = 20) -> Path:
    (tmp_path / "m").mkdir(exist_ok=True)  # `up` refuses a model path that does not exist
    (tmp_path / "m" / "config.json").write_text("{}")  # ... and one without a readable config.json
    p, d, proxy, kv_p, kv_d = free_ports(5)
    path = tmp_path / "t.yaml"
    path.write_text(textwrap.dedent(f"""\
        model: {{path: {model}}}
        hosts: {{local: {{address: 127.0.0.1}}}}
        roles:
          prefill: [{{port: {p}, kv_port: {kv_p}}}]
          decode: [{{port: {d}, kv_port: {kv_d}}}]
        proxy: {{port: {proxy}}}
        timeouts: {{startup: 600, shutdown_grace: {grace}}}
        """))
    return path


@pytest.fixture
def trees(monkeypatch: pytest.MonkeyPatch) -> Iterator[Started]:
    """`start_local` starts a stand-in engine tree instead of the planned argv."""
    started = Started()
    real = processes.start_local

    def start_standin(argv, env, log):
        pid, created = real([sys.executable, "-c", ENGINE_TREE], {}, log)
        started.pids.append(pid)
        started.logs.append(Path(log))
        return pid, created

    monkeypatch.setattr(processes, "start_local", start_standin)
    yield started
    kill_all(started.processes())


def _sigint_when(ready: Callable[[], bool]) -> dict[str, float]:
    """SIGINT to the main thread once ``ready()``; returns {'sent': monotonic time} when it was sent."""
    sent: dict[str, float] = {}
    main_thread = threading.main_thread().ident
    assert main_thread is not None

    def watch() -> None:
        deadline = time.monotonic() + 60
        while not ready() and time.monotonic() < deadline:
            time.sleep(0.02)
        sent["sent"] = time.monotonic()
        signal.pthread_kill(main_thread, signal.SIGINT)

    threading.Thread(target=watch, daemon=True).start()
    return sent


def _trees_up(trees: Started, count: int) -> Callable[[], bool]:
    return lambda: trees.up(count)


def _up(path: Path, tmp_path: Path) -> int:
    return main(["up", str(path), "--run-dir", str(tmp_path / "run")])


def _state(tmp_path: Path) -> Path:
    return tmp_path / "run" / "runs" / "t" / "state.json"


def test_ctrl_c_while_engines_load_stops_everything_within_5_s(
        tmp_path: Path, trees: Started, capsys: pytest.CaptureFixture[str]) -> None:
    """The stand-ins never become healthy and one of each tree's children ignores SIGTERM."""
    sent = _sigint_when(_trees_up(trees, 2))
    assert _up(_topology(tmp_path), tmp_path) == 130
    elapsed = time.monotonic() - sent["sent"]
    assert elapsed < 5.0, f"took {elapsed:.1f} s"
    assert running(trees.processes()) == [] and len(trees.pids) == 2
    out = capsys.readouterr().out
    assert "interrupted: stopping everything that was started" in out
    assert f"prefill[0]: stopped (pid {trees.pids[0]})" in out and f"decode[0]: stopped (pid {trees.pids[1]})" in out
    assert not _state(tmp_path).exists()
    assert lock_holder(tmp_path / "run", "t") is None


def test_ctrl_c_while_a_process_starts_is_held_until_it_is_recorded(
        tmp_path: Path, trees: Started, monkeypatch: pytest.MonkeyPatch) -> None:
    """The signal lands while prefill[0] is being started: it is recorded, then stopped, and decode never starts."""
    standin = processes.start_local

    def slow_start(argv, env, log):
        result = standin(argv, env, log)
        time.sleep(1.0)   # the SIGINT arrives here, after the process started and before it is recorded
        return result

    monkeypatch.setattr(processes, "start_local", slow_start)
    sent = _sigint_when(lambda: len(trees.pids) == 1)
    assert _up(_topology(tmp_path), tmp_path) == 130
    assert time.monotonic() - sent["sent"] < 5.0
    assert len(trees.pids) == 1, "decode[0] was started after Ctrl-C"
    assert running(trees.processes()) == []
    assert not _state(tmp_path).exists()


@pytest.mark.parametrize("stage", ["port checks", "building the model"])
def test_ctrl_c_in_a_start_up_wait_stops_at_once(tmp_path: Path, trees: Started, monkeypatch: pytest.MonkeyPatch,
                                                 stage: str) -> None:
    """A wait that takes long (an SSH port check, building the embedded model) is cut short."""
    entered = threading.Event()

    def slow(*args, **kwargs):
        entered.set()
        time.sleep(60)
        return []

    if stage == "port checks":
        monkeypatch.setattr(launcher_mod, "busy_ports", slow)
    else:
        monkeypatch.setattr(launcher_mod, "ensure_model", slow)
    sent = _sigint_when(entered.is_set)
    assert _up(_topology(tmp_path, model="disagg:tiny"), tmp_path) == 130
    assert time.monotonic() - sent["sent"] < 2.0
    assert trees.pids == []


def test_a_second_signal_while_stopping_kills_at_once(tmp_path: Path, trees: Started,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """With a 60 s grace an interrupted start-up still stops within 5 s: the start-up grace is
    capped, and a second Ctrl-C during the stop sends SIGKILL at once."""
    monkeypatch.setattr(processes, "ABORT_GRACE_S", 60.0)
    sent = _sigint_when(_trees_up(trees, 2))
    main_thread = threading.main_thread().ident
    returned = threading.Event()
    guard = threading.Lock()     # the second signal is sent only while `up` has not returned
    second_sent: list[float] = []

    def second() -> None:
        while "sent" not in sent:
            time.sleep(0.02)
        if returned.wait(1.0):
            return
        with guard:
            if not returned.is_set():
                second_sent.append(time.monotonic())
                signal.pthread_kill(main_thread, signal.SIGINT)  # type: ignore[arg-type]

    thread = threading.Thread(target=second, daemon=True)
    thread.start()
    code = _up(_topology(tmp_path, grace=60), tmp_path)
    with guard:
        returned.set()
    thread.join()
    assert code == 130
    # each tree's stubborn child ignores SIGTERM: only the second signal can have ended the stop
    assert second_sent, "the stop ended before the second signal: nothing ignored SIGTERM"
    assert time.monotonic() - sent["sent"] < 5.0
    assert running(trees.processes()) == []


def test_a_second_up_of_the_same_topology_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Another `disagg up` (a subprocess holding the run's lock, as `up` does) owns the run."""
    path = _topology(tmp_path)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from disagg.launch.state import RunLock; "
         "lock = RunLock(sys.argv[1], 't'); assert lock.acquire() is None; print('held', flush=True); "
         "time.sleep(60)", str(tmp_path / "run")], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        assert lock_holder(tmp_path / "run", "t") == holder.pid
        assert _up(path, tmp_path) == 2
        err = capsys.readouterr().err
        assert err.strip() == (
            f"disagg: error: topology 't' is being started or run by another `disagg up` (pid {holder.pid}, "
            f"holding {tmp_path / 'run' / 'runs' / 't' / 'up.lock'}); stop it with Ctrl-C or `disagg down "
            f"{path}`, or wait for it")
    finally:
        holder.kill()
        holder.wait()
    assert lock_holder(tmp_path / "run", "t") is None  # the kernel dropped the dead holder's lock


def test_the_lock_is_held_for_the_launchers_life_and_not_inherited(tmp_path: Path, trees: Started,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher_mod, "http_status", lambda url, timeout=2.0: 200)
    monkeypatch.setattr(tracked_mod, "http_status", lambda url, timeout=2.0: 200)
    launcher = Launcher(build_deployment(load_topology(_topology(tmp_path), run_dir=str(tmp_path / "run"))),
                        echo=lambda _: None, poll_interval=0.01)
    launcher.up()
    try:
        assert lock_holder(tmp_path / "run", "t") == os.getpid()
        other = Launcher(launcher.dep, echo=lambda _: None)
        with pytest.raises(launcher_mod.LaunchError, match="is being started or run by another `disagg up`"):
            other.up()
        lock_path = str(tmp_path / "run" / "runs" / "t" / "up.lock")
        for proc in trees.processes():  # engines and proxy never hold the lock file open
            assert all(f.path != lock_path for f in proc.open_files())
    finally:
        launcher.stop(grace=0.5)
    assert lock_holder(tmp_path / "run", "t") is None
    assert running(trees.processes()) == []


def test_a_live_state_refuses_up_even_without_the_lock(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A detached run: its `up` has returned (lock free), a SIGKILLed leader left its group running."""
    rec, tree = start_tree(tmp_path, "decode[0]")
    try:
        save_state(RunState(topology="/t.yaml", name="t", run_dir=str(tmp_path / "run"),
                            proxy_url="http://127.0.0.1:1", started_at=1.0, up_pid=1, processes=[rec]))
        os.kill(rec.pid, signal.SIGKILL)
        time.sleep(0.3)
        assert _up(_topology(tmp_path), tmp_path) == 2
        captured = capsys.readouterr()
        assert captured.err.startswith("disagg: error: topology 't' is already up (decode[0] (leftovers); state ")
        assert "starting" not in captured.out and _state(tmp_path).exists()
    finally:
        processes.stop_local(rec, grace=0.5)
        kill_all(tree)


def test_stale_state_is_removed_with_its_network_namespace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    removed: list[str] = []
    monkeypatch.setattr(launcher_mod, "remove_namespace", removed.append)
    dead = ProcessRecord(name="prefill[0]", kind="engine", host="local", address="127.0.0.1", port=1,
                         url="http://x", log="l", pid=999_999_99, create_time=1.0)
    state = RunState(topology="/t.yaml", name="t", run_dir=str(tmp_path / "run"), proxy_url="http://127.0.0.1:1",
                     started_at=1.0, up_pid=1, processes=[dead], namespaces=["disagg-e1234567-a"])
    save_state(state)
    lines: list[str] = []
    launcher = Launcher(build_deployment(load_topology(_topology(tmp_path), run_dir=str(tmp_path / "run"))),
                        echo=lines.append)
    launcher._refuse_if_running()
    assert removed == ["disagg-e1234567-a"]
    assert not _state(tmp_path).exists()
    assert lines == ["link: removed network namespace disagg-e1234567-a of an earlier run",
                     f"removed the stale state of an earlier run (every process had exited): {_state(tmp_path)}"]


def test_a_state_on_an_unreachable_host_refuses_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.unit.launch.test_orphans import UNREACHABLE_SSH

    far = ProcessRecord(name="prefill[0]", kind="engine", host="far", address="10.0.0.2", port=1,
                        url="http://x", log="l", pid=4242, ssh=UNREACHABLE_SSH)
    save_state(RunState(topology="/t.yaml", name="t", run_dir=str(tmp_path / "run"), proxy_url="http://x",
                        started_at=1.0, up_pid=1, processes=[far]))
    launcher = Launcher(build_deployment(load_topology(_topology(tmp_path), run_dir=str(tmp_path / "run"))),
                        echo=lambda _: None)
    with pytest.raises(launcher_mod.LaunchError) as info:
        launcher._refuse_if_running()
    assert str(info.value).startswith("cannot tell whether topology 't' is still up: prefill[0] on far (me@far) "
                                      "did not answer over ssh")
    assert _state(tmp_path).exists()


def test_down_asks_the_owning_up_to_stop(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A stand-in for a foreground `disagg up`: holds the lock and a state, and on SIGTERM stops
    its engine tree, removes the state and exits. `down` leaves the stopping to it."""
    script = textwrap.dedent("""\
        import signal, sys, time
        from disagg.launch import processes
        from disagg.launch.state import RunLock, RunState, ProcessRecord, save_state, remove_state
        sys.path.insert(0, sys.argv[2])
        from tests.unit.launch.standins import start_tree
        from pathlib import Path
        lock = RunLock(sys.argv[1], 't'); assert lock.acquire() is None
        rec, tree = start_tree(Path(sys.argv[1]))
        state = RunState(topology='/t.yaml', name='t', run_dir=sys.argv[1], proxy_url='http://x', started_at=1.0,
                         up_pid=0, processes=[rec])
        save_state(state)
        def stop(*_):
            processes.stop_local(rec, grace=0.5); remove_state(state); sys.exit(0)
        signal.signal(signal.SIGTERM, stop)
        print('up', rec.pid, flush=True)
        while True:
            time.sleep(1)
        """)
    owner = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "run"), str(ROOT)],
                             stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert owner.stdout is not None
        line = owner.stdout.readline().split()
        assert line and line[0] == "up", line
        engine = psutil.Process(int(line[1]))
        tree = [engine, *engine.children(recursive=True)]
        assert main(["down", "--run-dir", str(tmp_path / "run")]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out == [f"t: `disagg up` (pid {owner.pid}) still owns this run; asking it to stop (SIGTERM)",
                       "t: down"]
        assert owner.wait(timeout=10) == 0
        assert running(tree) == []
    finally:
        owner.kill()
        owner.wait()


def test_a_signal_with_nobody_reading_stderr_still_stops_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """The detached supervisor's stderr is a pipe to an `up --detach` that may be gone: the
    handler's message must not raise (BrokenPipeError) before it tells the launcher to stop."""
    from disagg.commands import lifecycle

    class Gone:
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self) -> None:
            raise BrokenPipeError(32, "Broken pipe")

    told: list[str] = []

    class Launcher:
        def interrupt(self) -> None:
            told.append("interrupt")

    monkeypatch.setattr(sys, "stderr", Gone())
    signals = lifecycle._Signals(Launcher())  # type: ignore[arg-type]
    signals(signal.SIGTERM, None)
    assert told == ["interrupt"] and signals.stop
