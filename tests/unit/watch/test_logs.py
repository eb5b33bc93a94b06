"""disagg logs: which logs, read once or followed, local and "remote".

A remote process's state record holds the ssh argv prefix that reaches its host; here that prefix
is ``sh -c`` (or ``timeout 60 sh -c``), which runs the one command string exactly as the remote
login shell would, so the quoting of the remote command is tested without an sshd.
"""

from __future__ import annotations

import io
import signal
import threading
from pathlib import Path

import psutil
import pytest

from disagg.cli import main
from disagg.launch.state import STATE_FILE, ProcessRecord, RunState
from disagg.paths import LOGS, run_path
from disagg.watch import logs
from tests.unit.watch.child import disagg_child, sigterm_and_wait
from tests.waiting import wait_until


def write_state(run: RunState) -> None:
    """The run's state file, as `disagg up` writes it (not through save_state, which also lists
    the run among this user's live runs)."""
    path = run_path(run.run_dir, run.name) / STATE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(run.to_json())


def record(name: str, log: Path, ssh: list[str] | None = None, kind: str = "engine") -> ProcessRecord:
    return ProcessRecord(name=name, kind=kind, host="far" if ssh else "local", address="127.0.0.1", port=1,
                         url="http://127.0.0.1:1", log=str(log), pid=1, ssh=ssh)


def make_run(tmp_path: Path, ssh: list[str] | None = None) -> RunState:
    logdir = tmp_path / "log dir"          # a space: the remote command must quote it
    logdir.mkdir()
    for name, lines in (("prefill-0", 80), ("decode-0", 3), ("proxy", 2)):
        (logdir / f"{name}.log").write_text("".join(f"{name} line {i}\n" for i in range(lines)))
    run = RunState(topology="t.yaml", name="logged", run_dir=str(tmp_path), proxy_url="http://127.0.0.1:1",
                   started_at=0.0, up_pid=1, processes=[
                       record("prefill[0]", logdir / "prefill-0.log", ssh),
                       record("decode[0]", logdir / "decode-0.log"),
                       record("proxy", logdir / "proxy.log", kind="proxy")])
    write_state(run)
    return run


def test_choosing_by_role_or_name(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    assert [s.name for s in logs.sources(run)] == ["prefill[0]", "decode[0]", "proxy"]
    assert [s.name for s in logs.sources(run, "decode")] == ["decode[0]"]
    assert [s.name for s in logs.sources(run, "prefill[0]")] == ["prefill[0]"]
    supervisor = run_path(tmp_path, "logged") / LOGS / "supervisor.log"
    supervisor.parent.mkdir(parents=True)
    supervisor.write_text("supervising\n")
    assert [s.name for s in logs.sources(run, "supervisor")] == ["supervisor"]
    with pytest.raises(logs.LogsError, match=r"no process named or of role 'both'; choose one of: decode, "
                                             r"decode\[0\], prefill, prefill\[0\], proxy, supervisor"):
        logs.sources(run, "both")


def test_show_reads_local_and_remote_logs(tmp_path: Path) -> None:
    run = make_run(tmp_path, ssh=["sh", "-c"])
    out = io.StringIO()
    assert logs.show(logs.sources(run), out, lines=5) == 0
    text = out.getvalue()
    assert f"==> prefill[0] (far:{tmp_path}/log dir/prefill-0.log) <==" in text
    assert "prefill-0 line 79" in text and "prefill-0 line 74" not in text and "prefill-0 line 75" in text
    assert f"==> decode[0] ({tmp_path}/log dir/decode-0.log) <==\ndecode-0 line 0\n" in text


def test_show_says_which_log_it_could_not_read(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    Path(run.processes[1].log).unlink()
    out = io.StringIO()
    assert logs.show(logs.sources(run, "decode"), out) == 1
    assert "(could not read" in out.getvalue() and "decode-0.log" in out.getvalue()


def test_follow_interleaves_what_is_written_with_names(tmp_path: Path) -> None:
    run = make_run(tmp_path, ssh=["timeout", "60", "sh", "-c"])
    run.processes[1].ssh = ["timeout", "60", "sh", "-c"]   # both end when their `timeout` goes off
    chosen = logs.sources(run, "prefill") + logs.sources(run, "decode")
    out = io.StringIO()

    def write_then_time_out() -> None:
        """Append a line to each log once both tails are under way; once both lines came
        through, set off each `timeout` (SIGALRM: what its own timer sends it, exit status 124)."""
        try:
            wait_until(lambda: "prefill-0 line 79" in out.getvalue() and "decode-0 line 2" in out.getvalue(),
                       20, "the last line of each log")
            for rec in run.processes[:2]:
                with open(rec.log, "a") as fh:
                    fh.write(f"{rec.name} news\n")
            wait_until(lambda: out.getvalue().count(" news\n") == 2, 20, "both new lines followed")
        finally:
            for proc in psutil.Process().children():
                if proc.name() == "timeout":
                    proc.send_signal(signal.SIGALRM)

    writer = threading.Thread(target=write_then_time_out)
    writer.start()
    assert logs.follow(chosen, out, lines=1) == 1
    writer.join()
    lines = out.getvalue().splitlines()
    assert "prefill[0] | prefill-0 line 79" in lines and "decode[0]  | decode-0 line 2" in lines
    assert "prefill[0] | prefill[0] news" in lines and "decode[0]  | decode[0] news" in lines
    assert "(prefill[0]: tail ended, exit status 124)" in lines


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_run(tmp_path)
    assert main(["logs", "proxy", "--run-dir", str(tmp_path), "-n", "1"]) == 0
    assert capsys.readouterr().out.endswith("proxy line 1\n")
    assert main(["logs", "nosuch", "--run-dir", str(tmp_path)]) == 2
    assert "disagg: error: run logged has no process named or of role 'nosuch'" in capsys.readouterr().err
    assert main(["logs", "--run-dir", str(tmp_path), "-n", "-1"]) == 2


def test_sigterm_ends_following_and_its_tails(tmp_path: Path) -> None:
    make_run(tmp_path)
    with disagg_child("logs", "-f", "-n", "1", "--run-dir", str(tmp_path)) as child:
        assert child.stdout is not None
        first = child.stdout.readline()
        assert first.endswith(" line 79\n") or first.endswith(" line 2\n") or first.endswith(" line 1\n"), first
        tails = psutil.Process(child.pid).children()
        assert len(tails) == 3 and all(t.name() == "tail" for t in tails)
        sigterm_and_wait(child)
    assert not [t for t in tails if t.is_running() and t.status() != psutil.STATUS_ZOMBIE]
