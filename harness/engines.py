"""Deployments with real vLLM engines, for the end-to-end tests and the benchmarks (no fixtures here).

Engines are started only through the real CLI (`python -m disagg up --detach`)
and stopped with `disagg down`, exactly as a user would.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import os
import socket
import subprocess
import sys
import textwrap
import time
import urllib.parse
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import psutil

from disagg.errors import StateError
from disagg.launch.state import RunState, load_state
from disagg.prometheus_text import sample_sum
from harness.ports import free_ports

__all__ = ["free_ports"]  # the e2e modules' one import for ports (harness/ports.py picks them)

ROOT = Path(__file__).resolve().parents[1]
# Every engine in the tests: one pinned core, small KV cache, no torch.compile.
ENGINE_ARGS = '["-O0", "--max-num-seqs", "8"]'
#: The engine key every e2e deployment runs with (`disagg up` takes it from
#: DISAGG_ENGINE_KEY instead of generating one), so tests can reach engines
#: directly the way only the proxy may.
ENGINE_KEY = "e2e-engine-key-0123456789abcdef"
ENGINE_ENV = {"DISAGG_ENGINE_KEY": ENGINE_KEY}
#: topology lines for tests of the KV handoff itself: every prompt that can split does
#: (the default ``auto`` routing prefills most prompts on the decode engine on one machine)
SPLIT_EVERY_PROMPT = "routing: {policy: split}\n"


def disagg(*args: str, timeout: float = 900, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the real CLI in a subprocess (``python -m disagg ...``)."""
    return subprocess.run([sys.executable, "-m", "disagg", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**os.environ, **ENGINE_ENV, **(env or {})})


@dataclass
class Running:
    """A topology brought up by `disagg up --detach`."""

    topology: Path
    run_dir: Path
    proxy_url: str
    engines: dict[str, str]        # name -> base URL
    up_output: str
    process: subprocess.Popen[bytes] | None = None   # the foreground `disagg up`, if any

    def state(self) -> RunState:
        return load_state(self.run_dir / "runs" / self.topology.stem / "state.json")

    def process_tree(self) -> list[psutil.Process]:
        """Every live process of this run (recorded pids and their descendants); none when the
        run has no state file any more."""
        try:
            records = self.state().processes
        except (OSError, StateError):
            return []
        return process_trees(rec.pid for rec in records)

    def down(self) -> subprocess.CompletedProcess[str]:
        return disagg("down", str(self.topology), "--run-dir", str(self.run_dir), timeout=180)


def process_trees(pids: Iterable[int]) -> list[psutil.Process]:
    """Each of ``pids`` that still runs, followed by its descendants (the processes a deployment,
    a proxy or a stand-in tree left to check or stop)."""
    procs: list[psutil.Process] = []
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs += [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
    return procs


def write_topology(path: Path, model: Path, *, proxy_port: int, roles: str, connector: str = "nixl",
                   extra: str = "") -> Path:
    """A topology file for the tests on one machine (loopback)."""
    path.write_text(textwrap.dedent(f"""\
        model: {{path: {model}, max_model_len: 8192, served_name: tiny}}
        engine: vllm
        connector: {connector}
        link: {{type: loopback}}
        proxy: {{host: 127.0.0.1, port: {proxy_port}}}
        hosts:
          local: {{address: 127.0.0.1, device: cpu}}
        roles:
        """) + textwrap.indent(textwrap.dedent(roles), "  ") + textwrap.dedent(extra))
    return path


def _running(topology: Path, run_dir: Path, output: str, process: subprocess.Popen[bytes] | None = None) -> Running:
    state = load_state(run_dir / "runs" / topology.stem / "state.json")
    engines = {r.name: r.url for r in state.processes if r.kind == "engine"}
    return Running(topology, run_dir, state.proxy_url, engines, output, process)


def bring_up(topology: Path, run_dir: Path) -> Running:
    """`disagg up --detach`; raises AssertionError with the output on failure."""
    try:
        done = disagg("up", str(topology), "--detach", "--run-dir", str(run_dir))
    except BaseException:   # a timeout kills only `up --detach`, not the supervisor it started
        with contextlib.suppress(Exception):
            disagg("down", str(topology), "--run-dir", str(run_dir), timeout=180)
        raise
    assert done.returncode == 0, f"disagg up failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    try:
        return _running(topology, run_dir, done.stdout)
    except BaseException:  # the caller never gets the run to stop: stop it here
        disagg("down", str(topology), "--run-dir", str(run_dir), timeout=180)
        raise


def bring_up_foreground(topology: Path, run_dir: Path, timeout: float = 900) -> Running:
    """`disagg up` in the foreground (as a user runs it); returns once it says it is serving."""
    log = run_dir.with_suffix(".up.log")
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "disagg", "up", str(topology), "--run-dir", str(run_dir)],
                                stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, **ENGINE_ENV})
    deadline = time.monotonic() + timeout
    while "serving; Ctrl-C stops every process" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"disagg up did not come up (exit {proc.poll()}):\n{log.read_text()}")
        time.sleep(0.5)
    return _running(topology, run_dir, log.read_text(), proc)


def post_json(url: str, body: dict, timeout: float = 300, key: str | None = None) -> dict:
    """POST JSON, return the decoded reply (raises on HTTP errors); ``key``: a bearer token."""
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.load(resp)


def open_stream(proxy_url: str, prompt: str, *, timeout: float = 120
                ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """POST a streamed completion of ``prompt`` that would run to the model's context (8000 tokens
    asked, ``ignore_eos``) to the proxy and read up to its first token event, so the engine is
    generating; the open connection and response, for the test to hang up or read on.

    A test that hangs up should do so at once: on these CPUs the tiny model generates thousands
    of tokens in a few seconds while its API server, sharing the engine's core, answers /metrics
    slowly, so reading an engine's gauges first can outlast the whole request."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8000, "ignore_eos": True, "temperature": 0,
            "stream": True}
    url = urllib.parse.urlsplit(proxy_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()[:500]
    for _ in range(8):   # a chunk-size line, the event, a blank line (chunked transfer encoding)
        line = resp.fp.readline()
        assert line, "the stream ended before its first event"
        if line.startswith(b"data: "):
            assert b'"text"' in line, line[:500]
            return conn, resp
    raise AssertionError("no event among the stream's first lines")


def plain_answer(engine: str, body: dict, timeout: float = 300) -> str:
    """The greedy text one engine answers to a completion or chat ``body`` sent to it directly
    (with the engine key), streamed when ``body`` says so."""
    chat = "messages" in body
    url = engine + ("/v1/chat/completions" if chat else "/v1/completions")
    if not body.get("stream"):
        reply = post_json(url, body, timeout=timeout, key=ENGINE_KEY)
        return reply["choices"][0]["message"]["content"] if chat else reply["choices"][0]["text"]
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={
        "content-type": "application/json", "Authorization": f"Bearer {ENGINE_KEY}"})
    text = []
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:]).get("choices") or []:
                    text.append((choice.get("delta") or {}).get("content") or "" if chat else choice.get("text", ""))
    return "".join(text)


def routed_stream(proxy: str, body: dict, timeout: float = 600) -> tuple[str, str]:
    """(X-Disagg-Route, the answer's text) of one streamed completion through the proxy (the proxy
    learns an engine's prefill rate from the first token of streamed replies)."""
    route, text, _ = timed_stream(proxy, body, timeout)
    return route, text


def timed_stream(proxy: str, body: dict, timeout: float = 600) -> tuple[str, str, float]:
    """:func:`routed_stream`, and the seconds from sending the request to its first chunk with a
    choice (the client's TTFT)."""
    req = urllib.request.Request(proxy + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"content-type": "application/json"})
    text: list[str] = []
    sent, first = time.monotonic(), math.inf
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        route = resp.headers["X-Disagg-Route"]
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                chunk = [c.get("text", "") for c in json.loads(line[6:]).get("choices") or []]
                if chunk and first == math.inf:
                    first = time.monotonic()
                text += chunk
    return route, "".join(text), first - sent


def get_text(url: str, timeout: float = 30) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def settled_metrics(engine: str, timeout: float = 30, *, step: bool = False) -> str:
    """An engine's /metrics once it runs and queues nothing and its finished-request and
    generated-token counters have stopped moving (two reads 0.3 s apart agree).

    vLLM counts a finished request after its last output went out, so a client that just got its
    answer can read the counters before they include it (seen in CI: a hang-up test's 'before',
    read right after the previous test's last answer, was one finished request short). A test
    that compares an engine's counters across a request reads its 'before' here.

    ``step``: first make the engine step (one token of a plain prompt, with the engine key). A KV
    connector hands its counts to vLLM with the engine's next step, so a transfer that ended after
    the engine's last step (a stream an earlier test cut short) is counted only with the next
    request's (seen in CI: a batch's 'before' one failed transfer short)."""
    if step:
        post_json(engine + "/v1/completions", {"model": "tiny", "prompt": "settle the counters", "max_tokens": 1,
                                               "temperature": 0}, timeout=120, key=ENGINE_KEY)
    deadline = time.monotonic() + timeout
    last: tuple[float, float, float] | None = None
    while True:
        text = get_text(engine + "/metrics")
        now = (sample_sum(text, "vllm:num_requests_running") + sample_sum(text, "vllm:num_requests_waiting"),
               sample_sum(text, "vllm:request_success_total"), sample_sum(text, "vllm:generation_tokens_total"))
        if now[0] == 0 and now == last:
            return text
        assert time.monotonic() < deadline, f"{engine} did not settle within {timeout:.0f} s: {now}"
        last = now
        time.sleep(0.3)


def wait_proxy_healthy(url: str, timeout: float = 60, process: subprocess.Popen[bytes] | None = None) -> None:
    """Wait until ``GET url/health`` answers 200 (a proxy takes an engine back within one probe
    interval of its restart; until then it answers 503 with Retry-After); with ``process`` (the
    proxy's), fail as soon as it has exited."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=10) as resp:
                if resp.status == 200:
                    return
        except OSError:  # HTTPError (503), refused, timeout
            pass
        exited = process.poll() if process is not None else None
        assert exited is None, f"the proxy exited ({exited}) before {url}/health answered"
        assert time.monotonic() < deadline, f"{url}/health did not answer 200 within {timeout:.0f} s"
        time.sleep(0.2)


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def engine_processes(model: Path) -> list[psutil.Process]:
    """Live vLLM API servers started on ``model`` (its path in their argv), whoever started them."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info.get("cmdline") or []
        if "vllm.entrypoints.openai.api_server" in cmd and str(model) in cmd:
            found.append(proc)
    return found


def session_processes(leader: int) -> list[psutil.Process]:
    """Every live process in the session (and process group) an engine leader started, leader or not:
    what must be gone once that engine is stopped or restarted."""
    found = []
    for proc in psutil.process_iter():
        try:
            if (os.getsid(proc.pid) == leader or os.getpgid(proc.pid) == leader) and \
                    proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (OSError, psutil.Error):
            continue
    return found


def bring_up_socket_pd(e2e_dir: Path, model: Path, name: str, *, extra: str = "",
                       wait_s: float = 60, wire_format: str = "raw", streaming: bool = False,
                       args: str = ENGINE_ARGS) -> Running:
    """1 prefill + 1 decode with the socket connector over loopback behind the proxy, one pinned
    core each (``<name>.yaml``, run directory ``run-<name>`` in ``e2e_dir``); ``extra``: more
    topology lines; ``wire_format``: the connector's (raw, fp8); ``streaming``: the connector's
    streamed transfers; ``args``: the engines' (a YAML list). Starts only once no other engine on
    ``model`` runs (waiting up to ``wait_s``), so that never more than two engines run at once."""
    deadline = time.monotonic() + wait_s
    while (left := engine_processes(model)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"engines of another deployment still run: {[p.pid for p in left]}"
    proxy_port, p_port, d_port, p_kv, d_kv = free_ports(5)
    roles = (f"prefill: [{{port: {p_port}, kv_port: {p_kv}, cpus: [0], args: {args}}}]\n"
             f"decode: [{{port: {d_port}, kv_port: {d_kv}, cpus: [1], args: {args}}}]\n")
    topo = write_topology(e2e_dir / f"{name}.yaml", model, proxy_port=proxy_port, roles=roles,
                          connector=f"{{type: socket, wire_format: {wire_format}, "
                                    f"streaming: {str(streaming).lower()}}}", extra=extra)
    return bring_up(topo, e2e_dir / f"run-{name}")


def busy_ports(ports: list[int], timeout_s: float = 10) -> list[int]:
    """The ports of ``ports`` still taken after waiting up to ``timeout_s`` for all to free."""
    deadline = time.monotonic() + timeout_s
    while (busy := [p for p in ports if not port_is_free(p)]) and time.monotonic() < deadline:
        time.sleep(0.5)
    return busy
