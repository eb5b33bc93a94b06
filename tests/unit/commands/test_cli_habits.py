"""Command-line habits: did-you-mean for subcommands, a closed pipe, `check --json`, warnings and
`check --here`, `up` refusing what cannot run here, runs found from any directory (`status`,
`status --json`, `down`), an idempotent `down`, and embedded models under the project."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from disagg.cli import main
from disagg.launch import live
from disagg.launch.state import ProcessRecord, RunState, save_state
from disagg.topology import load_topology

ROOT = Path(__file__).resolve().parents[3]


def _write(path: Path, a: str = "127.0.0.1", b: str = "127.0.0.1", extra: str = "") -> Path:
    path.write_text(textwrap.dedent(f"""\
        model: disagg:tiny
        hosts:
          a: {{address: {a}}}
          b: {{address: {b}}}
        roles:
          prefill: [{{host: a, port: 8100}}]
          decode: [{{host: b, port: 8200}}]
        link: ethernet
        """) + extra)
    return path


def test_a_mistyped_subcommand_gets_a_suggestion(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["chek", "x.yaml"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.rstrip().endswith("(did you mean 'check'?)")


def test_a_word_close_to_no_subcommand_gets_none(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["zzzz"])
    assert "did you mean" not in capsys.readouterr().err


def test_a_reader_that_closes_the_pipe_gets_no_traceback() -> None:
    files = sorted(str(p) for p in (ROOT / "topologies").glob("*.yaml"))
    proc = subprocess.Popen([sys.executable, "-m", "disagg", "check", *files], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().startswith(b"topology ")
    proc.stdout.close()  # as `| head -1` does
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141
    assert "Traceback" not in err and "BrokenPipeError" not in err


def test_check_json_reports_errors_with_lines_and_plans(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = _write(tmp_path / "good.yaml")
    bad = _write(tmp_path / "bad.yaml").read_text().replace("8100", "70000").replace("8200", "0")
    (tmp_path / "bad.yaml").write_text(bad)
    assert main(["check", "--json", str(good), str(tmp_path / "bad.yaml")]) == 2
    report = json.loads(capsys.readouterr().out)["files"]
    assert report[0]["valid"] is True and [e["name"] for e in report[0]["engines"]] == ["prefill[0]", "decode[0]"]
    assert report[0]["errors"] == []
    assert report[0]["engines"][0]["argv"][1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert report[1]["valid"] is False
    assert [(e["line"], e["field"]) for e in report[1]["errors"]] == [(6, "roles.prefill[0].port"),
                                                                      (7, "roles.decode[0].port")]


def test_check_warns_about_another_machines_file_and_here_refuses_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    topo = _write(tmp_path / "far.yaml", "192.0.2.20", "192.0.2.30")
    assert main(["check", str(topo)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"disagg: warning: {topo}:3: hosts.a.address: 192.0.2.20 is not an address of "
                             "this machine")
    assert err[1].startswith(f"disagg: warning: {topo}:4: hosts.b.address: ")
    assert main(["check", "--here", str(topo)]) == 2
    err_here = capsys.readouterr().err
    assert err_here.startswith(f"disagg: error: {topo}: 2 errors:\n  {topo}:3: hosts.a.address: ")
    assert main(["check", "--here", str(_write(tmp_path / "near.yaml"))]) == 0
    assert capsys.readouterr().err == ""


def test_check_json_puts_another_machines_findings_under_warnings(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    topo = _write(tmp_path / "far.yaml", "192.0.2.20", "127.0.0.1", extra="proxy: {host: 0.0.0.0}\n")
    assert main(["check", "--json", str(topo)]) == 0
    report = json.loads(capsys.readouterr().out)["files"][0]
    assert [w["field"] for w in report["warnings"]] == ["hosts.a.address", "proxy.host"]
    assert main(["check", "--json", "--here", str(topo)]) == 2
    report = json.loads(capsys.readouterr().out)["files"][0]
    assert [e["field"] for e in report["errors"]] == ["hosts.a.address"] and report["valid"] is False


def test_up_refuses_what_cannot_run_here_before_starting_anything(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    topo = _write(tmp_path / "far.yaml", "192.0.2.20")
    assert main(["up", str(topo), "--run-dir", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.startswith(f"disagg: error: {topo}:3: hosts.a.address: 192.0.2.20 is not an "
                                              "address of this machine, and the host has no ssh")
    assert not (tmp_path / "run").exists()


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _started_elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> RunState:
    """A run whose state lives in a project directory, and this test standing in another one."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    elsewhere.mkdir()
    topo = _write(project.mkdir() or project / "t.yaml")
    run = RunState(topology=str(topo), name="t", run_dir=str(project / ".disagg"), proxy_url="http://127.0.0.1:8000",
                   started_at=1.0, up_pid=1,
                   processes=[ProcessRecord(name="decode[0]", kind="engine", host="b", address="127.0.0.1", port=8200,
                                            url="http://127.0.0.1:8200", log="/dev/null", pid=_dead_pid())])
    save_state(run)
    monkeypatch.chdir(elsewhere)
    return run


def test_status_finds_a_run_from_another_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    run = _started_elsewhere(tmp_path, monkeypatch)
    assert main(["status", "--json"]) == 1  # its one process is not running
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert [(r["name"], r["topology"], r["run_dir"]) for r in runs] == [("t", run.topology, run.run_dir)]
    assert [(p["name"], p["state"], p["healthy"]) for p in runs[0]["processes"]] == [
        ("decode[0]", "not running", False)]
    assert main(["status", run.topology]) == 1  # by its file, too
    assert capsys.readouterr().out.startswith("t: proxy http://127.0.0.1:8000 (topology ")


def test_down_from_another_directory_stops_the_run_and_a_second_down_is_no_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    run = _started_elsewhere(tmp_path, monkeypatch)
    assert main(["down"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("t: down")
    assert not (Path(run.run_dir) / "runs" / "t" / "state.json").exists()
    assert list(live.live_dir().iterdir()) == []
    assert main(["down"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("; nothing to stop")
    assert main(["status"]) == 0
    assert capsys.readouterr().out == "nothing is running\n"


def test_status_lists_every_live_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    run = _started_elsewhere(tmp_path, monkeypatch)
    save_state(RunState(topology=run.topology, name="u", run_dir=run.run_dir, proxy_url="http://127.0.0.1:8001",
                        started_at=1.0, up_pid=1))
    assert main(["status"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("t: proxy http://127.0.0.1:8000") and "\n\nu: proxy http://127.0.0.1:8001" in out
    assert main(["down"]) == 2  # which one? name it
    assert "several topologies are up" in capsys.readouterr().err


def test_a_live_run_whose_directory_is_gone_is_forgotten(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = _started_elsewhere(tmp_path, monkeypatch)
    assert live.live_runs() == [Path(run.run_dir).resolve() / "runs" / "t"]
    (Path(run.run_dir) / "runs" / "t" / "state.json").unlink()
    assert live.live_runs() == [] and list(live.live_dir().iterdir()) == []


def test_an_embedded_model_lives_in_the_files_project_not_the_current_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    project = tmp_path / "project"
    (project / "topologies").mkdir(parents=True)
    (project / "pyproject.toml").write_text("")
    topo = _write(project / "topologies" / "t.yaml")
    monkeypatch.chdir(tmp_path)
    assert load_topology(topo).model.path == str(project / ".disagg" / "models" / "tiny")
    assert load_topology(topo, run_dir=str(tmp_path / "r")).model.path == str(tmp_path / "r" / "models" / "tiny")
    loose = _write(tmp_path / "loose.yaml")  # in no project: the current directory's .disagg
    assert load_topology(loose).model.path == str(tmp_path / ".disagg" / "models" / "tiny")


def test_logs_finds_a_run_from_another_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    run = _started_elsewhere(tmp_path, monkeypatch)
    log = tmp_path / "decode-0.log"
    log.write_text("decode says hello\n")
    run.processes[0].log = str(log)
    save_state(run)
    assert main(["logs", "decode"]) == 0
    assert "decode says hello" in capsys.readouterr().out
