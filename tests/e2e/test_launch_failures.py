"""`disagg up` when things go wrong, with real engines: an engine that cannot start
(a clear error naming the instance, host, port and the tail of its log); Ctrl-C while
the engines load (everything stops within 5 s); an API server SIGKILLed after `up`
itself crashed (`down` still stops the EngineCore it left behind); a NIXL port taken while the
engines load (reported from the engine's log at once). Nothing is left running. (A decode API
server SIGKILLed mid-stream and restarted: tests/e2e/test_pd.py; an engine restarted by the
detached supervisor: tests/e2e/test_ssh_remote.py.)"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from disagg.errors import StateError
from disagg.launch.state import load_state
from harness.engines import (
    ENGINE_ARGS,
    ENGINE_ENV,
    ROOT,
    disagg,
    free_ports,
    port_is_free,
    session_processes,
    write_topology,
)

pytestmark = pytest.mark.e2e
#: how long `disagg down` may take in the orphan test, with the default grace (timeouts.shutdown_grace,
#: 20 s): the prefill API server, still loading, loses its SIGTERM and is sent another once the rest
#: of its group has exited (down took 21 s when it waited the grace out, now about 3 s)
DOWN_WITHIN_S = 10.0


def test_bad_model_fails_fast_with_log_tail(engine_lock: None, tmp_path: Path) -> None:
    model = tmp_path / "broken-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    proxy_port, p_port, d_port = free_ports(3)
    topo = write_topology(tmp_path / "broken.yaml", model, proxy_port=proxy_port,
                          roles=f"prefill: [{{port: {p_port}, cpus: [0], args: [-O0]}}]\n"
                                f"decode: [{{port: {d_port}, cpus: [1], args: [-O0]}}]\n",
                          extra="timeouts: {startup: 240}\n")
    before = {p.pid for p in psutil.process_iter()}
    started = time.monotonic()
    done = disagg("up", str(topo), "--detach", "--run-dir", str(tmp_path / "run"), timeout=300)
    elapsed = time.monotonic() - started

    assert done.returncode == 2, done.stdout + done.stderr
    assert elapsed < 240
    first = done.stderr.splitlines()[0]
    assert first.startswith("disagg: error: ")
    assert (f"prefill[0] on 127.0.0.1:{p_port} exited" in first) or (f"decode[0] on 127.0.0.1:{d_port} exited" in first)
    assert "--- last lines of its log ---" in done.stderr
    assert "no-such-architecture" in done.stderr  # the engine's own complaint reached the user
    assert "startup failed: stopping everything that was started" in done.stdout
    # Nothing survives: no new process with our ports, ports free, no state file.
    time.sleep(1)
    ours = {str(p_port), str(d_port)}
    leftovers = [p for p in psutil.process_iter(["pid", "cmdline"])
                 if p.pid not in before and ours & set(p.info["cmdline"] or [])]
    assert not leftovers
    assert port_is_free(p_port) and port_is_free(d_port)
    assert not (tmp_path / "run" / "runs" / "broken" / "state.json").exists()


@dataclass(frozen=True)
class _Deployment:
    """A 1P1D topology written for one test: its file, and the ports it names."""

    topo: Path
    run_dir: Path
    ports: list[int]          # prefill, decode, proxy: free again once everything stopped
    decode_kv_port: int

    def state_path(self) -> Path:
        return self.run_dir / "runs" / self.topo.stem / "state.json"


def _two_engines(tmp_path: Path, tiny_model: Path, name: str) -> _Deployment:
    # free side-channel ports too: engines left behind by a failure never block the next deployment's
    proxy_port, p_port, d_port, p_kv, d_kv = free_ports(5)
    topo = write_topology(tmp_path / f"{name}.yaml", tiny_model, proxy_port=proxy_port,
                          roles=f"prefill: [{{port: {p_port}, kv_port: {p_kv}, cpus: [0], args: {ENGINE_ARGS}}}]\n"
                                f"decode: [{{port: {d_port}, kv_port: {d_kv}, cpus: [1], args: {ENGINE_ARGS}}}]\n")
    return _Deployment(topo, tmp_path / "run", [p_port, d_port, proxy_port], d_kv)


@contextlib.contextmanager
def _up_in_background(dep: _Deployment, log: Path, *args: str) -> Iterator[subprocess.Popen[bytes]]:
    """`disagg up` of ``dep`` as a child process writing to ``log``; on leaving, it is killed if still
    running and `disagg down --grace 0` stops whatever it left."""
    with open(log, "wb") as out:
        up = subprocess.Popen([sys.executable, "-m", "disagg", "up", str(dep.topo), "--run-dir", str(dep.run_dir),
                               *args], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, **ENGINE_ENV})
    try:
        yield up
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        disagg("down", str(dep.topo), "--run-dir", str(dep.run_dir), "--grace", "0", timeout=120)


def _engines_with_children(state_path: Path, up: subprocess.Popen[bytes], timeout: float = 240) -> dict[str, int]:
    """Wait until both engines are recorded and each leader has spawned its EngineCore; name -> leader pid."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert up.poll() is None, f"disagg up exited early ({up.returncode})"
        try:
            leaders = {r.name: r.pid for r in load_state(state_path).processes if r.kind == "engine"}
        except StateError:
            leaders = {}
        if len(leaders) == 2 and all(psutil.Process(pid).children() for pid in leaders.values()):
            return leaders
        time.sleep(0.2)
    raise AssertionError("the engines did not spawn their EngineCore in time")


@pytest.mark.parametrize("detach", [False, True], ids=["foreground", "detach"])
def test_ctrl_c_while_real_engines_load_stops_everything_within_5_s(
        engine_lock: None, tmp_path: Path, tiny_model: Path, detach: bool) -> None:
    """With --detach the Ctrl-C reaches the `up` that waits for the supervisor, which passes it on."""
    dep = _two_engines(tmp_path, tiny_model, "loading")
    with _up_in_background(dep, tmp_path / "up.log", *(["--detach"] if detach else [])) as up:
        leaders = _engines_with_children(dep.state_path(), up)
        tree = [p for pid in leaders.values() for p in session_processes(pid)]
        assert len(tree) >= 4, "each engine should have its API server and EngineCore running"
        sent = time.monotonic()
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=30) == 130, (tmp_path / "up.log").read_text()
        elapsed = time.monotonic() - sent
        print(f"Ctrl-C while loading: `disagg up` exited {elapsed:.2f} s after SIGINT ({len(tree)} processes)")
        assert elapsed < 5.0, (tmp_path / "up.log").read_text()
        assert not [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not [p for pid in leaders.values() for p in session_processes(pid)]
        assert all(port_is_free(p) for p in dep.ports)
        assert "interrupted: stopping everything that was started" in (tmp_path / "up.log").read_text()
        assert not dep.state_path().exists()


def test_a_kv_port_taken_while_the_engines_load_fails_the_start_at_once(
        engine_lock: None, tmp_path: Path, tiny_model: Path) -> None:
    """The decode engine's NIXL handshake port is taken after `up` checked it and before the engine
    binds it (what a port picked from the ephemeral range and taken by another process's socket
    does): vLLM's listener thread dies and the engine would wait forever; `up` reports it from the
    engine's log within a minute, not after timeouts.startup (900 s), and stops everything."""
    dep = _two_engines(tmp_path, tiny_model, "taken")
    with _up_in_background(dep, tmp_path / "up.log", "--detach") as up:
        with socket.socket() as taker:
            leaders = _engines_with_children(dep.state_path(), up)
            taker.bind(("127.0.0.1", dep.decode_kv_port))
            taker.listen()
            taken = time.monotonic()
            code = up.wait(timeout=600)
            out = (tmp_path / "up.log").read_text()
            print(f"kv_port taken: `disagg up` exited {time.monotonic() - taken:.0f} s later")
            assert code == 2, out
            assert time.monotonic() - taken < 300, out
            assert (f"disagg: error: decode[0] on 127.0.0.1:{dep.ports[1]} will not become healthy: its log says "
                    f'"zmq.error.ZMQError: Address already in use (addr=\'tcp://127.0.0.1:{dep.decode_kv_port}\')"'
                    ) in out
            assert "startup failed: stopping everything that was started" in out
        assert not [p for pid in leaders.values() for p in session_processes(pid)]
        assert all(port_is_free(p) for p in dep.ports)
        assert not dep.state_path().exists()


def test_down_leaves_nothing_after_the_api_server_and_up_are_sigkilled(
        engine_lock: None, tmp_path: Path, tiny_model: Path) -> None:
    """An orphaned engine core with real engines: the decode API server is SIGKILLed (as the OOM killer does) and
    `disagg up` itself (the detached supervisor) crashed; vLLM's EngineCore stays in the dead leader's
    group until `down` sweeps it."""
    dep = _two_engines(tmp_path, tiny_model, "orphans")
    with _up_in_background(dep, tmp_path / "up.log", "--detach") as up:
        state_path = dep.state_path()
        leaders = _engines_with_children(state_path, up)
        supervisor = load_state(state_path).up_pid
        assert supervisor != up.pid  # --detach: a supervisor process of its own does the work
        os.kill(supervisor, signal.SIGKILL)  # it crashes: nobody will stop or restart the engines but `down`
        up.kill()
        up.wait()
        decode = leaders["decode[0]"]
        left_behind = [p for p in session_processes(decode) if p.pid != decode]
        os.kill(decode, signal.SIGKILL)
        time.sleep(1.0)
        assert left_behind and all(p.is_running() for p in left_behind), "EngineCore should outlive its leader"
        tree = [p for pid in leaders.values() for p in session_processes(pid)]
        downed = time.monotonic()
        done = disagg("down", str(dep.topo), "--run-dir", str(dep.run_dir), timeout=120)
        took = time.monotonic() - downed
        print(done.stdout, f"`disagg down` took {took:.1f} s", sep="")
        assert done.returncode == 0, done.stdout + done.stderr
        assert took < DOWN_WITHIN_S, done.stdout
        assert f"decode[0]: its leader (pid {decode}) had exited; stopped the" in done.stdout
        assert f"prefill[0]: stopped (pid {leaders['prefill[0]']})" in done.stdout
        time.sleep(0.5)
        assert not [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not [p for pid in leaders.values() for p in session_processes(pid)]
        assert all(port_is_free(p) for p in dep.ports)
        assert not state_path.exists()
