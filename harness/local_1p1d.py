"""A 1P1D on this machine for the benchmark scripts: brought up and down under the engine lock
(:func:`local_1p1d`; any topology file: :func:`deployed`), and a streamed completion timed to its
first token (:func:`streamed_ttft`).

Ports come from :mod:`harness.ports` (below the kernel's ephemeral range, each handed out once).
Server-sent events are parsed by :class:`disagg.sse.SSEParser`, the one SSE parser of the project
(correct wherever a read splits an event).
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from disagg.launch.state import load_state, run_path
from disagg.sse import SSEParser
from disagg.topology import Topology, load_topology
from harness.ports import free_ports

#: bytes asked of the socket per read: whatever has arrived, up to this much
READ_BYTES = 64 * 1024


def streamed_ttft(url: str, body: dict[str, Any], key: str | None = None, *,
                  timeout: float = 600.0) -> tuple[float, dict[str, Any]]:
    """POST ``body`` to ``url`` (a completions endpoint) as a streamed request with usage.

    Returns (seconds from sending to the first event with choices, the usage of
    the last event that had one). ``key``: sent as ``Authorization: Bearer``
    (what an engine guarded by the run's engine key wants).
    """
    headers = {"content-type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps({**body, "stream": True, "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(url, data=data, headers=headers)
    parser = SSEParser()
    t0 = time.perf_counter()
    ttft, usage = 0.0, {}
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        while chunk := resp.read1(READ_BYTES):
            for event in parser.feed(chunk):
                if event.done:
                    continue
                payload = event.json()
                if payload.get("choices") and not ttft:
                    ttft = time.perf_counter() - t0
                usage = payload.get("usage") or usage
    return ttft, usage


#: the engine lock: no more than two engines on this machine at once (the e2e tests take it too)
LOCK = os.environ.get("DISAGG_ENGINE_LOCK", "/tmp/disagg-engines.lock")


@dataclass(frozen=True)
class Running1P1D:
    """A 1P1D brought up by :func:`local_1p1d`: what the scripts send requests to."""

    topology: Topology
    proxy_url: str
    engine_urls: dict[str, str]     # by process name: "prefill[0]", "decode[0]"
    engine_key: str                 # what the engines answer to (Authorization: Bearer)
    engine_pids: dict[str, int]     # by process name: each engine's leader (its processes are its tree)


@contextmanager
def local_1p1d(name: str, *, connector: str, model: str = "tiny", routing: str = "split",
               engine_args: str = '["-O0"]', decode_env: dict[str, str] | None = None) -> Iterator[Running1P1D]:
    """Hold the engine lock, write a 1P1D topology on this machine (``model``: an embedded model's
    name or a model directory's path; prefill pinned to core 0, decode to core 1, free ports),
    ``disagg up --detach`` it, yield it, and ``disagg down`` it whatever happens. Raises
    SystemExit(1) with the launcher's output when the up fails. ``engine_args``: a YAML/JSON list
    for both engines; ``decode_env``: the decode engine's extra environment."""
    work = Path(tempfile.mkdtemp(prefix=f"disagg-{name}-"))
    proxy_port, p_port, d_port, p_kv, d_kv = free_ports(5)
    topo_file = work / f"{name}-{connector}.yaml"
    topo_file.write_text(f"""\
model: {{path: {json.dumps(model if "/" in model else f"disagg:{model}")}, max_model_len: 4096, served_name: m}}
engine: vllm
connector: {connector}
link: {{type: loopback}}
routing: {{policy: {routing}}}
proxy: {{host: 127.0.0.1, port: {proxy_port}}}
hosts:
  local: {{address: 127.0.0.1, device: cpu}}
roles:
  prefill: [{{host: local, port: {p_port}, kv_port: {p_kv}, cpus: [0], args: {engine_args}}}]
  decode: [{{host: local, port: {d_port}, kv_port: {d_kv}, cpus: [1], args: {engine_args},
             env: {json.dumps(decode_env or {})}}}]
""")
    with deployed(topo_file, work / "run") as running:
        yield running


@contextmanager
def deployed(topo_file: Path, run_dir: Path) -> Iterator[Running1P1D]:
    """Hold the engine lock, ``disagg up --detach`` the topology in ``topo_file`` with a fresh
    engine key and state under ``run_dir``, yield it, and ``disagg down`` it whatever happens.
    Raises SystemExit(1) with the launcher's output when the up fails."""
    key = secrets.token_hex(16)
    env = {**os.environ, "DISAGG_ENGINE_KEY": key}
    cli = [sys.executable, "-m", "disagg"]
    down = [*cli, "down", str(topo_file), "--run-dir", str(run_dir)]
    with open(LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        up = subprocess.run([*cli, "up", str(topo_file), "--detach", "--run-dir", str(run_dir)], text=True,
                            capture_output=True, env=env)
        try:
            if up.returncode != 0:
                print(up.stdout + up.stderr, file=sys.stderr)
                raise SystemExit(1)
            topo = load_topology(topo_file, run_dir=str(run_dir))
            state = load_state(run_path(str(run_dir), topo.name) / "state.json")
            yield Running1P1D(topo, state.proxy_url,
                              {r.name: r.url for r in state.processes if r.kind == "engine"}, key,
                              {r.name: r.pid for r in state.processes if r.kind == "engine"})
        finally:
            stopped = subprocess.run(down, text=True, capture_output=True, env=env)
            if stopped.returncode != 0:
                print(stopped.stdout + stopped.stderr, file=sys.stderr)
