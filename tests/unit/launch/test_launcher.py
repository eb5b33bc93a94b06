"""Launcher behaviour that needs no engine: busy ports, missing state, state files."""

from __future__ import annotations

import socket
import textwrap
from pathlib import Path

import pytest

from disagg.cli import main
from disagg.launch.state import ProcessRecord, RunState, find_states, load_state, save_state


def _topology(tmp_path: Path, port: int) -> Path:
    path = tmp_path / "t.yaml"
    path.write_text(textwrap.dedent(f"""\
        model: disagg:tiny
        hosts: {{local: {{address: 127.0.0.1}}}}
        roles:
          prefill: [{{port: {port}}}]
          decode: [{{port: {port + 1}}}]
        proxy: {{port: {port + 2}}}
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


def test_down_with_nothing_running(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["down", "--run-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("disagg: error: nothing is running: no state files under ")


def test_down_for_a_topology_that_is_not_up(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["down", str(_topology(tmp_path, 20000)), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "no run state at" in err and "nothing was started with this topology" in err


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
