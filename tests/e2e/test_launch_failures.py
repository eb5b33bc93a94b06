"""`disagg up` with an engine that cannot start: a clear error naming the
instance, host, port and the tail of its log, and nothing left running."""

from __future__ import annotations

import json
import time
from pathlib import Path

import psutil
import pytest

from tests.e2e.engines import disagg, free_ports, port_is_free, write_topology

pytestmark = pytest.mark.e2e


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
