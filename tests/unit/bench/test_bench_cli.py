"""``disagg bench`` on the command line (disagg/commands/bench.py), against the stand-in OpenAI server."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import pytest

from disagg.bench.workload import Workload
from disagg.cli import main
from disagg.commands import bench as bench_command
from disagg.commands.bench import old_spelling
from disagg.proxy.config import ENGINE_KEY_ENV


@pytest.mark.parametrize(("argv", "message"), [
    (["http://x:1", "--rates", "0"], "every value must be positive"),
    (["http://x:1", "--rates", "fast"], "bad --rates"),
    (["http://x:1", "--arrival", "closed"], "needs --concurrency"),
    (["http://x:1", "--arrival", "closed", "--concurrency", "2", "--rates", "1"], "--rates is for open-loop"),
    (["http://x:1", "--concurrency", "1,2"], "one cap"),
    (["http://x:1", "--slo", "ttft=soon"], "bad duration"),
    (["http://x:1", "--classes", "a"], "NAME=INPUT"),
    (["http://x:1", "extra.yaml"], "unexpected arguments after the URL"),
    (["compare"], "needs at least one TOPOLOGY.yaml"),
    (["x:1"], "bad endpoint URL"),
    (["http://x:1", "--header", "novalue"], "bad --header"),
    (["serve", "http://x:1", "--rates", "0"], "every value must be positive"),
    (["serve", "http://x:1", "--repeats", "0"], "bad --repeats 0"),
    (["serve", "http://x:1", "extra.yaml"], "unexpected arguments after the URL"),
    (["compare", "a.yaml", "--routing", "fastest"], "bad --routing 'fastest'"),
    (["compare", "a.yaml", "--routing", "auto,auto"], "bad --routing"),
])
def test_bad_options_exit_2_with_a_message(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


async def test_bench_url_end_to_end(standin, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", standin.url, "-n", "6", "--classes", "short=20,long=200", "--output-len", "3",
            "--rates", "100,inf", "--slo", "ttft=1s,tpot=500ms", "--json", str(tmp_path / "r.json"),
            "--out", str(tmp_path / "rep"), "--no-progress", "--label", "standin",
            "--prefill-host", "box", "--prefill-probe", "2", "--run-dir", str(tmp_path / "run")]
    # the CLI runs its own event loop: call it off the stand-in's loop
    assert await asyncio.to_thread(main, argv) == 0
    out = capsys.readouterr().out
    assert "SLO ttft <= 1000 ms, tpot <= 500 ms" in out
    assert len([line for line in out.splitlines() if line.startswith("standin")]) == 2 * 3   # 2 rates x (all+2)
    doc = json.loads((tmp_path / "r.json").read_text())
    runs = doc["standin"]["runs"]
    assert [r["rate"] for r in runs] == [100.0, "inf"]
    assert runs[0]["metrics"]["all"]["completed"] == 6 and runs[0]["metrics"]["all"]["slo_attainment"] == 1.0
    assert (tmp_path / "rep" / "ttft_cdf.png").exists() and (tmp_path / "rep" / "report.md").exists()
    stored = json.loads((tmp_path / "run" / "measurements" / "prefill.json").read_text())
    assert stored[standin.model]["box"]["prompt_tokens_per_s"] > 0
    assert all(b["max_tokens"] == 3 and b["ignore_eos"] for b in standin.bodies[1:13])


def test_old_spelling_inserts_serve() -> None:
    assert old_spelling(["bench", "http://x:1", "-n", "3"]) == ["bench", "serve", "http://x:1", "-n", "3"]
    assert old_spelling(["--debug", "bench", "http://x:1"]) == ["--debug", "bench", "serve", "http://x:1"]
    assert old_spelling(["bench", "--rates", "1", "http://x:1"])[:2] == ["bench", "serve"]
    for argv in (["bench", "serve", "http://x:1"], ["bench", "compare", "a.yaml"], ["bench", "--help"],
                 ["bench"], ["up", "http://x:1"], ["check", "bench"]):
        assert old_spelling(argv) == argv


def test_help_names_the_subcommands_and_the_old_form(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    assert "{serve,compare,prefill}" in out and "disagg bench URL [options]" in out and "old spelling" in out


async def test_bench_serve_with_repeats(standin, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "serve", standin.url, "-n", "4", "--classes", "short=20,long=200", "--output-len", "2",
            "--rates", "200", "--repeats", "3", "--json", str(tmp_path / "r.json"), "--no-progress",
            "--label", "s", "--prompt-salt", "t-"]
    assert await asyncio.to_thread(main, argv) == 0
    out = capsys.readouterr().out
    assert "with repeats: medians" in out
    runs = json.loads((tmp_path / "r.json").read_text())["s"]["runs"]
    assert [r["repeat"] for r in runs] == [0, 1, 2] and all(r["metrics"]["all"]["completed"] == 4 for r in runs)
    assert len([line for line in out.splitlines() if line.startswith("s ")]) == 3      # all + 2 classes, medians


def test_bench_compare_passes_routing_and_repeats(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    seen: dict[str, object] = {}

    def fake_compare(files: list[Path], workload: Workload, steps: list[object], out: Path,
                     **kwargs: object) -> dict[str, object]:
        seen.update(kwargs, files=files, out=out, seed=workload.seed)
        return {}

    monkeypatch.setattr(bench_command, "compare", fake_compare)
    # compare puts the run's engine key into os.environ for the `disagg up` it starts: through
    # monkeypatch, so that it is gone again after this test (a leaked key changed later tests' configs)
    monkeypatch.setenv(ENGINE_KEY_ENV, "test-key")
    argv = ["bench", "compare", "a.yaml", "b.yaml", "--routing", "auto,split", "--repeats", "3", "--seed", "7",
            "--out", str(tmp_path / "o"), "--prefill-probe", "0"]
    assert main(argv) == 0
    assert seen["files"] == [Path("a.yaml"), Path("b.yaml")] and seen["out"] == tmp_path / "o"
    assert seen["routing"] == ["auto", "split"] and seen["repeats"] == 3 and seen["seed"] == 7
    assert seen["probe_count"] == 0 and seen["engine_key"] == "test-key"


def test_a_sigterm_during_compare_runs_its_clean_up(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Killed (SIGTERM), ``bench compare`` still takes down what it brought up: the signal ends
    it as Ctrl-C does, through compare's ``finally`` (here a stand-in compare's)."""
    cleaned: list[str] = []

    def fake_compare(files: list[Path], workload: Workload, steps: list[object], out: Path,
                     **kwargs: object) -> dict[str, object]:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)            # the signal's handler raises before this ends
            return {}
        finally:
            cleaned.append("down")

    monkeypatch.setattr(bench_command, "compare", fake_compare)
    monkeypatch.setenv(ENGINE_KEY_ENV, "test-key")
    before = signal.getsignal(signal.SIGTERM)
    started = time.monotonic()
    assert main(["bench", "compare", "a.yaml", "--out", str(tmp_path / "o"), "--prefill-probe", "0"]) == 130
    assert cleaned == ["down"] and time.monotonic() - started < 5
    assert signal.getsignal(signal.SIGTERM) is before       # the handler is the command's own only
