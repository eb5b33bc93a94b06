"""Launcher behaviour that needs no engine: busy ports, missing state, state files."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import textwrap
from pathlib import Path

import pytest

from disagg.cli import main
from disagg.deployment import build_deployment
from disagg.launch.launcher import Launcher
from disagg.launch.processes import start_local, stop_local
from disagg.launch.state import ProcessRecord, RunState, find_states, load_state, save_state
from disagg.proxy.config import API_KEY_ENV, ENGINE_KEY_ENV
from disagg.topology import load_topology
from harness.ports import free_ports


def _topology(tmp_path: Path, port: int) -> Path:
    """Prefill on ``port``; every other port free right now."""
    decode, proxy, kv_p, kv_d = free_ports(4)
    path = tmp_path / "t.yaml"
    path.write_text(textwrap.dedent(f"""\
        model: disagg:tiny
        hosts: {{local: {{address: 127.0.0.1}}}}
        roles:
          prefill: [{{port: {port}, kv_port: {kv_p}}}]
          decode: [{{port: {decode}, kv_port: {kv_d}}}]
        proxy: {{port: {proxy}}}
        """))
    return path


def test_busy_port_stops_before_anything_starts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = main(["up", str(_topology(tmp_path, port)), "--detach", "--run-dir", str(tmp_path / "run")])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err.strip() == (
        f"disagg: error: port already in use, nothing was started: 127.0.0.1:{port} (roles.prefill[0].port); "
        "stop whatever holds it (or `disagg down`) or change the topology")
    assert "starting" not in captured.out
    assert not (tmp_path / "run" / "runs" / "t" / "models").exists()
    assert find_states(tmp_path / "run") == []


def test_down_with_nothing_running_says_so_and_succeeds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["down", "--run-dir", str(tmp_path)]) == 0  # idempotent: a second `down` is no error
    captured = capsys.readouterr()
    assert captured.out.startswith("nothing is running: no state files under ")
    assert captured.out.rstrip().endswith("; nothing to stop") and captured.err == ""


def test_down_for_a_topology_that_is_not_up(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["down", str(_topology(tmp_path, 20000)), "--run-dir", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "no run state at" in out and "nothing was started with this topology" in out
    assert out.rstrip().endswith("; nothing to stop")


def test_state_round_trip(tmp_path: Path) -> None:
    state = RunState(topology="/t.yaml", name="t", run_dir=str(tmp_path), proxy_url="http://127.0.0.1:1",
                     started_at=1.0, up_pid=2,
                     processes=[ProcessRecord(name="decode[0]", kind="engine", host="h", address="198.18.0.2",
                                              port=8200, url="http://198.18.0.2:8200", log="l", pid=3,
                                              ssh=["ssh", "-p", "2222", "root@198.18.0.2"])])
    path = save_state(state)
    assert load_state(path) == state
    assert find_states(tmp_path) == [path]


def test_status_of_a_dead_run_says_not_running(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = RunState(topology="/t.yaml", name="t", run_dir=str(tmp_path), proxy_url="http://127.0.0.1:1",
                     started_at=1.0, up_pid=2,
                     processes=[ProcessRecord(name="proxy", kind="proxy", host="local", address="127.0.0.1",
                                              port=1, url="http://127.0.0.1:1", log="l", pid=999_999_99,
                                              create_time=1.0)])
    save_state(state)
    assert main(["status", "--run-dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "proxy" in out and "not running" in out


def _launcher(tmp_path: Path, extra: str) -> Launcher:
    path = tmp_path / "p.yaml"
    path.write_text(textwrap.dedent("""\
        model: disagg:tiny
        hosts: {a: {address: 127.0.0.1}, b: {address: 127.0.0.2}}
        """) + textwrap.dedent(extra))
    return Launcher(build_deployment(load_topology(path, run_dir=str(tmp_path))), echo=lambda _: None)


def test_proxy_command_for_disaggregated(tmp_path: Path) -> None:
    launcher = _launcher(tmp_path, """\
        roles:
          prefill: [{host: a, port: 8100}, {host: b, port: 8101}]
          decode: [{host: b, port: 8200}]
        proxy: {port: 9000, api_key: s3cret, fallback: never}
        timeouts: {request: 120}
        """)
    argv = launcher._proxy_argv()
    assert argv[1:4] == ["-m", "disagg", "proxy"]
    assert argv[argv.index("--prefill"):argv.index("--prefill") + 3] == [
        "--prefill", "http://127.0.0.1:8100", "http://127.0.0.2:8101"]
    assert argv[argv.index("--decode"):argv.index("--decode") + 3] == ["--decode", "http://127.0.0.2:8200", "--prefill"]
    assert argv[argv.index("--fallback") + 1] == "never" and argv[argv.index("--port") + 1] == "9000"
    assert argv[argv.index("--request-timeout") + 1] == "120.0"
    assert "s3cret" not in " ".join(argv)  # never visible in ps
    assert launcher.engine_key and launcher.engine_key not in " ".join(argv)
    assert launcher._proxy_env() == {API_KEY_ENV: "s3cret", ENGINE_KEY_ENV: launcher.engine_key}


def test_proxy_command_for_colocated_replicas(tmp_path: Path) -> None:
    launcher = _launcher(tmp_path, """\
        roles:
          both: [{host: a, port: 8300}, {host: b, port: 8300}]
        """)
    argv = launcher._proxy_argv()
    assert "--prefill" not in argv
    assert argv[argv.index("--decode"):argv.index("--decode") + 3] == ["--decode", "http://127.0.0.1:8300",
                                                                      "http://127.0.0.2:8300"]
    assert launcher._proxy_env() == {ENGINE_KEY_ENV: launcher.engine_key}  # no API key: only the engine key


def test_supervise_survives_a_lost_prefill_but_not_the_last_decode(tmp_path: Path) -> None:
    launcher = _launcher(tmp_path, """\
        roles:
          prefill: [{host: a, port: 8100}]
          decode: [{host: b, port: 8200}]
        restart: {policy: "no"}
        """)
    launcher.poll_interval = 0.05
    lines: list[str] = []
    launcher.echo = lines.append
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    for name in ("prefill[0]", "decode[0]", "proxy"):
        log = tmp_path / f"{name}.log"
        pid, created = start_local(sleeper, {}, log)
        launcher.run.processes.append(ProcessRecord(name=name, kind="engine", host="a", address="127.0.0.1",
                                                    port=1, url="http://x", log=str(log), pid=pid,
                                                    create_time=created))
    by_name = {r.name: r for r in launcher.run.processes}
    try:
        os.kill(by_name["prefill[0]"].pid, signal.SIGKILL)
        checks = iter(range(40))
        assert launcher.supervise(lambda: next(checks, None) is None) == 0  # still serving
        assert sum("prefill[0] on 127.0.0.1:1 killed by SIGKILL" in line for line in lines) == 1  # reported once
        os.kill(by_name["decode[0]"].pid, signal.SIGKILL)
        assert launcher.supervise(lambda: False) == 1
        assert lines[-1] == "error: the service is lost (every decode engine failed and is not restarted); stopping"
    finally:
        for rec in launcher.run.processes:
            stop_local(rec, grace=1.0)


def test_a_state_file_from_a_newer_disagg_can_still_be_read(tmp_path: Path) -> None:
    state = RunState(topology="/t.yaml", name="t", run_dir=str(tmp_path), proxy_url="http://127.0.0.1:1",
                     started_at=1.0, up_pid=2,
                     processes=[ProcessRecord(name="proxy", kind="proxy", host="local", address="127.0.0.1",
                                              port=1, url="http://127.0.0.1:1", log="l", pid=3)])
    path = save_state(state)
    data = json.loads(path.read_text())
    data["added_later"] = 1
    data["processes"][0]["also_added_later"] = "x"
    path.write_text(json.dumps(data))
    assert load_state(path) == state


def test_stuck_line_reads_whole_lines_once_and_skips_the_launchers_own(tmp_path: Path) -> None:
    launcher = _launcher(tmp_path, """\
        roles:
          prefill: [{host: a, port: 8100}]
          decode: [{host: b, port: 8200}]
        """)
    log = tmp_path / "decode-0.log"
    rec = ProcessRecord(name="decode[0]", kind="engine", host="b", address="127.0.0.2", port=8200,
                        url="http://127.0.0.2:8200", log=str(log), pid=1)
    stuck = "zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:5601')"
    assert launcher.processes.stuck_line(rec, 0) == (None, 0)           # no log yet
    log.write_text("INFO loading\n--- disagg up: restart 1 after its log says " + stuck + " ---\nzmq.error.ZMQ")
    line, scanned = launcher.processes.stuck_line(rec, 0)
    assert line is None and scanned == log.read_text().rindex("\n") + 1   # the partial line waits
    with log.open("a") as fh:
        fh.write("Error: Address already in use (addr='tcp://127.0.0.1:5601')\nmore\n")
    assert launcher.processes.stuck_line(rec, scanned) == (stuck, len(log.read_text()))
    assert launcher.processes.stuck_line(rec, len(log.read_text())) == (None, len(log.read_text()))
    remote = ProcessRecord(**{**rec.__dict__, "ssh": ["ssh", "b"]})
    assert launcher.processes.stuck_line(remote, 0) == (None, 0)       # remote logs are not read per poll
