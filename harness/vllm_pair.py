"""Start and stop real vLLM engines for P/D tests and benchmarks (no disagg launcher).

Each engine runs in its own session (process group) pinned to one core, as
the machine's two cores demand; ``stop`` kills the whole group. The caller
holds the engine lock (``flock /tmp/disagg-engines.lock``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from disagg_connectors.cpu_amx_attention import ENV as CPU_ATTENTION_AMX_ENV
from disagg_connectors.cpu_amx_attention import OFF as CPU_ATTENTION_AMX_OFF

from disagg.prometheus_text import sample_sum
from harness.ports import free_port

API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


@dataclass
class Engine:
    """One running vLLM API server."""

    name: str
    port: int
    proc: subprocess.Popen
    log_path: Path
    extra: dict[str, Any] = field(default_factory=dict)
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def log_tail(self, n: int = 40) -> str:
        """The last lines of the engine's log, for error messages."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        """Kill the engine's whole process group and wait for it (idempotent)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=15)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=15)


def start_engine(name: str, model: str, core: int, kv_config: dict[str, Any] | None, env: dict[str, str],
                 log_dir: Path, args: list[str] | None = None, max_model_len: int = 8192,
                 prefix_caching: bool = False, host: str = "127.0.0.1",
                 wrap: Callable[[list[str]], list[str]] | None = None) -> Engine:
    """Start ``python -m vllm.entrypoints.openai.api_server`` pinned to ``core``.

    Prefix caching is off unless asked for, so a repeated prompt is computed
    (or transferred) again. ``host`` is the address the API server binds;
    ``wrap`` prefixes the command line (e.g. to run it inside a network
    namespace with ``ip netns exec``).
    """
    port = free_port()
    argv = [sys.executable, "-m", API_SERVER_MODULE, "--model", model, "--served-model-name", "tiny",
            "--host", host, "--port", str(port), "--max-model-len", str(max_model_len),
            "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching", *(args or [])]
    if kv_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_config)]
    full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(core),
                "OMP_NUM_THREADS": "1", CPU_ATTENTION_AMX_ENV: CPU_ATTENTION_AMX_OFF, **env}  # as disagg up
    log_path = log_dir / f"{name}.log"
    log = open(log_path, "wb")
    if wrap is not None:
        argv = wrap(argv)
    proc = subprocess.Popen(argv, env=full_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    return Engine(name, port, proc, log_path, host=host)


def wait_healthy(engines: list[Engine], timeout_s: float = 400) -> None:
    """Wait until every engine answers /health; raise with the log tail if one dies or times out."""
    deadline = time.monotonic() + timeout_s
    pending = list(engines)
    while pending:
        for eng in list(pending):
            if not eng.alive():
                raise RuntimeError(f"engine {eng.name} exited with {eng.proc.returncode}:\n{eng.log_tail()}")
            try:
                with urllib.request.urlopen(eng.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        pending.remove(eng)
            except OSError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"engines {[e.name for e in pending]} not healthy after {timeout_s} s:\n"
                               + "\n".join(e.log_tail() for e in pending))
        if pending:
            time.sleep(1)


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus metric's samples at ``url``/metrics matching ``labels``."""
    with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
        return sample_sum(r.read().decode(), name, **labels)
