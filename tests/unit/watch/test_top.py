"""disagg top against stand-ins on loopback: a proxy and engines that answer /metrics and /health
as the real ones do, one engine that answers garbage, one that does not answer at all."""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from disagg.cli import main
from disagg.launch.state import STATE_FILE, ProcessRecord, RunState
from disagg.paths import run_path
from disagg.proxy.metrics import ProxyMetrics
from disagg.watch import top
from disagg.watch.scrape import scrape
from harness.ports import free_port
from tests.unit.watch.child import disagg_child, sigterm_and_wait
from tests.unit.watch.test_snapshot import engine_text


def write_state(run: RunState) -> None:
    """The run's state file, as `disagg up` writes it (not through save_state, which also lists
    the run among this user's live runs)."""
    path = run_path(run.run_dir, run.name) / STATE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(run.to_json())


class StandIns:
    """Answers per path prefix: /proxy (the proxy), /p (a healthy engine), /d (garbage, 503)."""

    def __init__(self) -> None:
        self.proxy = ProxyMetrics()
        self.nixl_bytes = 0.0

    def answer(self, path: str) -> tuple[int, str]:
        if path == "/proxy/metrics":
            return 200, self.proxy.render().decode()
        if path == "/p/metrics":
            return 200, engine_text(2, 1, 0.25, nixl_bytes=self.nixl_bytes)
        if path == "/p/health":
            return 200, ""
        if path == "/d/metrics":
            return 200, "<html>Bad Gateway</html>\n"
        if path == "/d/health":
            return 503, "starting"
        return 404, "no"


@pytest.fixture
def stand_ins() -> Iterator[tuple[StandIns, str]]:
    state = StandIns()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            code, body = state.answer(self.path)
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def run_state(tmp_path: Path, base: str) -> RunState:
    dead = f"http://127.0.0.1:{free_port()}"
    def engine(name: str, url: str, restarts: int = 0) -> ProcessRecord:
        return ProcessRecord(name=name, kind="engine", host="local", address="127.0.0.1", port=1, url=url,
                             log=str(tmp_path / f"{name}.log"), pid=1, restarts=restarts)
    procs = [engine("prefill[0]", base + "/p"), engine("decode[0]", base + "/d", restarts=1),
             engine("decode[1]", dead),
             ProcessRecord(name="proxy", kind="proxy", host="local", address="127.0.0.1", port=1,
                           url=base + "/proxy", log=str(tmp_path / "proxy.log"), pid=1)]
    run = RunState(topology="t.yaml", name="watched", run_dir=str(tmp_path), proxy_url=base + "/proxy",
                   started_at=0.0, up_pid=1, processes=procs)
    write_state(run)
    return run


def test_scrape_reads_every_engine_and_says_what_failed(stand_ins: tuple[StandIns, str], tmp_path: Path) -> None:
    _, base = stand_ins
    got = scrape(run_state(tmp_path, base), timeout=2.0)
    assert got.proxy is not None and got.proxy.has("disagg_proxy_active_requests")
    assert got.engines["prefill[0]"] is not None and got.engines["prefill[0]"].total("vllm:num_requests_running") == 2
    assert got.engines["decode[0]"] is None and "not Prometheus text" in got.errors["decode[0]"]
    assert got.engines["decode[1]"] is None and got.health["decode[1]"] is None and got.errors["decode[1]"]
    assert got.health == {"prefill[0]": 200, "decode[0]": 503, "decode[1]": None}
    assert "proxy" not in got.errors


def test_once_json_through_the_cli(stand_ins: tuple[StandIns, str], tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    state, base = stand_ins
    run_state(tmp_path, base)
    state.proxy.ttft.observe(0.4)
    state.proxy.route.labels(path="split", reason="predicted").inc(2)
    assert main(["top", "--once", "--json", "--run-dir", str(tmp_path)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["run"] == "watched" and data["window"]["seconds"] is None
    assert data["rates"]["interval_s"] == pytest.approx(1.0, abs=0.5)
    assert data["ttft_s"]["count"] == 1 and data["routes"] == {"split": 2.0}
    engines = {e["name"]: e for e in data["engines"]}
    assert engines["prefill[0]"]["running"] == 2.0 and engines["prefill[0]"]["healthy"] is True
    assert engines["decode[0]"]["healthy"] is False and engines["decode[0]"]["restarts"] == 1
    assert engines["decode[1]"]["healthy"] is None


def test_once_as_text(stand_ins: tuple[StandIns, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, base = stand_ins
    run_state(tmp_path, base)
    assert main(["top", "--once", "--run-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "disagg top - watched" in out and "since the proxy started:" in out
    assert "\x1b[" not in out
    assert any(line.startswith("prefill[0]") and " ok " in line and "25.0%" in line for line in out.splitlines())


def test_live_refreshes_rates_and_window(stand_ins: tuple[StandIns, str], tmp_path: Path) -> None:
    state, base = stand_ins
    run = run_state(tmp_path, base)
    out = io.StringIO()
    ticks = iter(range(100))

    def sleep(_: float) -> None:   # between refreshes: the engine moves 1 MB of KV, one request comes in
        state.nixl_bytes += 1e6 * (next(ticks) + 1)
        state.proxy.requests.labels(endpoint="completions", path="disaggregated").inc()

    top.live(lambda: run, out, as_json=True, frames=3, sleep=sleep, interval=0.0)
    frames = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(frames) == 3
    assert frames[0]["rates"]["interval_s"] is None and frames[0]["window"]["seconds"] is None
    assert frames[1]["rates"]["requests_per_s"] > 0 and frames[2]["rates"]["handoff_bytes_per_s"] > 0
    assert frames[2]["window"]["seconds"] > 0


def test_live_on_a_pipe_writes_plain_screens(stand_ins: tuple[StandIns, str], tmp_path: Path) -> None:
    _, base = stand_ins
    run = run_state(tmp_path, base)
    out = io.StringIO()
    top.live(lambda: run, out, frames=2, sleep=lambda _: None)
    text = out.getvalue()
    assert text.count("disagg top - watched") == 2 and "\x1b[" not in text


def test_window_keeps_the_last_minute() -> None:
    from disagg.watch.snapshot import Scrape
    window = top.Window(span=60.0)
    def at(t: float) -> Scrape:
        return Scrape(at=t, proxy=None, engines={}, health={})
    assert window.add(at(0.0)) == (None, None)
    previous, base = window.add(at(1.0))
    assert previous is not None and previous.at == 0.0 and base is not None and base.at == 0.0
    for t in range(2, 200):
        previous, base = window.add(at(float(t)))
    assert previous is not None and previous.at == 198.0
    assert base is not None and 199.0 - base.at == pytest.approx(60.0, abs=1.0)
    assert len(window.scrapes) <= 62


def test_nothing_running_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["top", "--once", "--run-dir", str(tmp_path)]) == 2
    assert "nothing is running" in capsys.readouterr().err


def test_sigterm_ends_the_live_view_cleanly(stand_ins: tuple[StandIns, str], tmp_path: Path) -> None:
    _, base = stand_ins
    run_state(tmp_path, base)
    with disagg_child("top", "--run-dir", str(tmp_path), "--interval", "0.2") as child:
        assert child.stdout is not None
        assert child.stdout.readline().startswith("disagg top - watched")
        sigterm_and_wait(child)
