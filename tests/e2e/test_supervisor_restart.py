"""The detached supervisor restarts a SIGKILLed decode engine, on the session's shared socket 1P1D.

Decode's API server is SIGKILLed mid-stream under `up --detach`: the streaming client gets an
error event within 5 s, nothing of the old decode is left, the supervisor starts it again (shown
by `disagg status` and its log), the proxy takes it back and later requests are served.

Nothing here depends on the connector, so the test needs no deployment of its own: it runs on the
shared socket deployment (tests/e2e/shared_deployment.py) after every other module that uses it
(``RESTARTS_SHARED``: it leaves a restarted decode engine behind) and before the test that takes
it down, whose `disagg down` also stops the supervisor (``down_problems``).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest
from tokenizers import Tokenizer

from disagg.launch.state import ProcessRecord, load_state
from disagg.prompts import exact_prompt
from harness.engines import Running, disagg, open_stream, post_json, wait_proxy_healthy
from tests.e2e.shared_deployment import SOCKET, SharedDeployment, socket_deployment
from tests.e2e.test_launch_failures import _session

pytestmark = pytest.mark.e2e
#: the session's shared deployment this module uses; it restarts its decode engine (tests/e2e/conftest.py)
SHARED_DEPLOYMENT = SOCKET
RESTARTS_SHARED = True


def _wait_restarted(state_path: Path, name: str, old_pid: int, timeout: float = 300) -> ProcessRecord:
    """Wait until the supervisor has started ``name`` again and it is healthy; its new record."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rec = next(r for r in load_state(state_path).processes if r.name == name)
        if rec.pid != old_pid and rec.status == "running":
            return rec
        time.sleep(0.5)
    raise AssertionError(f"{name} was not restarted within {timeout:.0f} s")


@pytest.fixture(scope="module")
def socket_run(shared_deployment: SharedDeployment, e2e_dir: Path, tiny_model: Path) -> Running:
    """The shared socket deployment (up already when the modules before this one used it)."""
    return socket_deployment(shared_deployment, e2e_dir, tiny_model)


def test_the_detached_supervisor_restarts_a_sigkilled_decode(socket_run: Running, tokenizer: Tokenizer) -> None:
    running = socket_run
    state_path = running.run_dir / "runs" / running.topology.stem / "state.json"
    supervisor = psutil.Process(running.state().up_pid)
    decode = next(r for r in running.state().processes if r.name == "decode[0]")
    assert (decode.restarts, decode.status) == (0, "running"), "the shared deployment's decode was restarted before"
    old_tree = _session(decode.pid)
    assert len(old_tree) >= 2, "the API server and its EngineCore"
    conn, resp = open_stream(running.proxy_url, exact_prompt(tokenizer, 40, "restart"), timeout=60)
    os.kill(decode.pid, signal.SIGKILL)
    killed = time.monotonic()
    rest = ""  # the raw chunked body (chunk sizes included) until the proxy ends the stream
    while (line := resp.fp.readline()) and "data: [DONE]" not in rest:
        rest += line.decode()
    ended = time.monotonic() - killed
    conn.close()
    print(f"the stream ended {ended:.2f} s after decode's API server was SIGKILLed")
    assert ended < 5.0
    assert '"error"' in rest and "data: [DONE]" in rest, rest[-500:]

    again = _wait_restarted(state_path, "decode[0]", decode.pid)
    assert not [p for p in old_tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert (again.restarts, again.last_exit) == (1, "killed by SIGKILL")
    assert supervisor.is_running() and load_state(state_path).up_pid == supervisor.pid
    wait_proxy_healthy(running.proxy_url)
    reply = post_json(running.proxy_url + "/v1/completions",
                      {"model": "tiny", "prompt": "after the restart", "max_tokens": 4, "temperature": 0})
    assert reply["choices"][0]["finish_reason"] == "length"
    status = disagg("status", str(running.topology), "--run-dir", str(running.run_dir), timeout=60)
    assert status.returncode == 0, status.stdout + status.stderr
    assert f"supervisor  pid {supervisor.pid}" in status.stdout
    assert "restarts 1, last exit: killed by SIGKILL" in status.stdout
    log = (state_path.parent / "logs" / "supervisor.log").read_text()
    assert "decode[0]: healthy again after" in log
