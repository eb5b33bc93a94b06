"""The proxy's front door against hostile clients, in front of real engines: what each check
sends, and the engine-side evidence that nothing got through.

Used by tests/e2e/test_nixl_crafted_inputs.py (the session's NIXL 1P1D) and
tests/e2e/test_socket_conformance.py (the socket connector's 1P1Ds), so no deployment is
started for these checks alone. Each function returns its measurements; the tests assert.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass

import psutil

from disagg.prometheus_text import sample_label, sample_sum
from harness.engines import Running, get_text, settled_metrics
from tests.e2e.conformance import kv_moved_problems

#: request targets that name another route once resolved ('..') or decoded ('%2e%2e', '%2f'):
#: each would reach the engine's /invocations, /inference or dev-mode routes with the engine key
DOT_SEGMENT_PATHS = (
    "/v1/../invocations",
    "/v1/%2e%2e/invocations",
    "/v1/%2E%2E/invocations",
    "/v1/x/../../invocations",
    "/v1/../../collective_rpc",
    "/v1/x/../../sleep",
    "/v1/%2e%2e/inference/v1/generate",
    "/v1/models%2f..%2f..%2finvocations",
)
#: engine routes the proxy does not serve, reached without tricks
UNSERVED_PATHS = ("/invocations", "/inference/v1/generate", "/ping", "/load", "/v1/embeddings")

COMPLETION = {"model": "tiny", "prompt": "The river runs past the mill and", "max_tokens": 2, "temperature": 0}


def _host_port(url: str) -> tuple[str, int]:
    parts = urllib.parse.urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


def raw_post(url: str, path: str, body: bytes, headers: dict[str, str] | None = None,
             timeout: float = 60) -> tuple[int, dict[str, str], bytes]:
    """POST ``body`` to ``path`` as it is (http.client resolves nothing); status, headers, body."""
    host, port = _host_port(url)
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def engine_requests(engines: dict[str, str]) -> float:
    """Requests every engine has finished or is running: what any request reaching them moves."""
    total = 0.0
    for url in engines.values():
        text = get_text(url + "/metrics")
        total += sum(sample_sum(text, name) for name in (
            "vllm:request_success_total", "vllm:num_requests_running", "vllm:num_requests_waiting"))
    return total


def unserved_paths_reaching_engines(run: Running) -> tuple[dict[str, int], float]:
    """Send every dot-segment and unserved path to the proxy; the status of each, and how much
    the engines' request counters grew meanwhile (must be 0)."""
    before = engine_requests(run.engines)
    body = json.dumps(COMPLETION).encode()
    statuses = {path: raw_post(run.proxy_url, path, body)[0] for path in DOT_SEGMENT_PATHS + UNSERVED_PATHS}
    time.sleep(2)  # an engine's counters trail its replies by a step or two
    return statuses, engine_requests(run.engines) - before


def proxy_process(run: Running) -> psutil.Process:
    """The deployment's ``disagg proxy`` process."""
    for proc in run.process_tree():
        try:
            cmd = proc.cmdline()
        except psutil.Error:
            continue
        if "disagg" in " ".join(cmd) and "proxy" in cmd:
            return proc
    raise AssertionError("no disagg proxy process in the deployment")


@dataclass
class BatchMemory:
    status: int
    choices: int
    rss_growth_mib: float
    seconds: float


def large_batch_memory(run: Running, prompts: int, shared_bytes: int) -> BatchMemory:
    """One batch of ``prompts`` short prompts beside a ``shared_bytes`` ``user`` field: the proxy's
    peak RSS growth while it is served (sampled every 10 ms)."""
    proxy = proxy_process(run)
    body = json.dumps({**COMPLETION, "prompt": [f"The mill {i} and" for i in range(prompts)],
                       "user": "u" * shared_bytes}).encode()
    before = peak = proxy.memory_info().rss
    result: dict[str, object] = {}

    def send() -> None:
        result["reply"] = raw_post(run.proxy_url, "/v1/completions", body, timeout=600)

    started = time.monotonic()
    sender = threading.Thread(target=send)
    sender.start()
    while sender.is_alive():
        peak = max(peak, proxy.memory_info().rss)
        time.sleep(0.01)
    sender.join()
    status, _, reply = result["reply"]  # type: ignore[misc]
    choices = len(json.loads(reply).get("choices", [])) if status == 200 else 0
    return BatchMemory(status, choices, (peak - before) / 2**20, time.monotonic() - started)


@dataclass
class Flood:
    served: int
    sent: int
    held_open: int            # hostile connections still open when the legitimate requests ended


def served_during_slowloris(run: Running, requests: int = 10, slow_heads: int = 64, slow_bodies: int = 16) -> Flood:
    """Hold ``slow_heads`` connections that never finish their request head and ``slow_bodies`` that
    never finish their body, then send ``requests`` legitimate ones: how many were served."""
    host, port = _host_port(run.proxy_url)
    hostile: list[socket.socket] = []
    try:
        for i in range(slow_heads + slow_bodies):
            s = socket.create_connection((host, port), timeout=10)
            if i < slow_heads:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            else:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100000\r\n\r\n{\"model\": ")
            hostile.append(s)
        body = json.dumps(COMPLETION).encode()
        served = sum(raw_post(run.proxy_url, "/v1/completions", body, timeout=120)[0] == 200
                     for _ in range(requests))
        return Flood(served, requests, sum(_still_open(s) for s in hostile))
    finally:
        for s in hostile:
            s.close()


def _still_open(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        return s.recv(1, socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


@dataclass
class Stalled:
    let_go_s: float | None      # until the proxy held no slot for the client (None: not within the wait)
    closed: bool                # the proxy closed the client's connection
    aborted: float              # decode requests aborted (those still generating when the proxy let go)
    rss_growth_mib: float       # the proxy's peak RSS growth meanwhile


#: the MSS the stalled client announces (:func:`stalled_stream_batch`)
STALLED_MSS = 1000


def stalled_stream_batch(run: Running, prompts: int, max_tokens: int, wait_s: float) -> Stalled:
    """A streamed batch whose client never reads (a 4 KiB receive buffer): whether and when the
    proxy lets go (its active-slot gauge back to 0, the connection closed).

    The client announces an MSS of :data:`STALLED_MSS` bytes, as a client behind a small-MTU link
    does: over loopback's 64 KiB segments the kernel grows the proxy's send buffer to about 3 MB
    before a write blocks, which the engine's events filled in 4-20 s; with small segments about
    110 KB do, in under a second, and the wait is the proxy's send timeout."""
    decode = run.engines["decode[0]"]
    proxy = proxy_process(run)

    def aborted() -> float:
        return sample_sum(get_text(decode + "/metrics"), "vllm:request_success_total", finished_reason="abort")

    def slots() -> float:
        return sample_sum(get_text(run.proxy_url + "/metrics"), "disagg_proxy_active_requests")

    before, rss = aborted(), proxy.memory_info().rss
    peak = rss
    host, port = _host_port(run.proxy_url)
    # 20 logprobs per token: large events, so the buffers towards the client fill in seconds
    body = json.dumps({**COMPLETION, "prompt": [f"Stalled {i} mill" for i in range(prompts)],
                       "max_tokens": max_tokens, "stream": True, "ignore_eos": True, "logprobs": 20}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, STALLED_MSS)
    s.connect((host, port))
    started = time.monotonic()
    let_go: float | None = None
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        time.sleep(1)
        while time.monotonic() - started < wait_s:
            peak = max(peak, proxy.memory_info().rss)
            if slots() == 0:
                let_go = time.monotonic() - started
                break
            time.sleep(0.5)
        return Stalled(let_go, _closed_by_peer(s), aborted() - before, (peak - rss) / 2**20)
    finally:
        s.close()


def _closed_by_peer(s: socket.socket, timeout: float = 10) -> bool:
    """Read what is buffered: True once the peer has closed (EOF or reset) within ``timeout``."""
    s.settimeout(timeout)
    try:
        while s.recv(1 << 20):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def engine_requests_running(engines: dict[str, str]) -> float:
    return sum(sample_sum(get_text(url + "/metrics"), "vllm:num_requests_running") for url in engines.values())


def prefill_kv_port(run: Running) -> int:
    """The prefill engine's KV listener port, from the deployment's topology."""
    import yaml
    topo = yaml.safe_load(run.topology.read_text())
    return int(topo["roles"]["prefill"][0]["kv_port"])


def kv_batch_problems(run: Running, prompts: list[str], tokens: list[int], headers: dict[str, str] | None = None,
                      settle_s: float = 15) -> tuple[int, dict[str, str], list[str]]:
    """A batch of fresh ``prompts`` (of ``tokens`` tokens each) through the proxy; its status, reply
    headers, and what the decode engine's socket-connector counters say did not move."""
    decode = run.engines["decode[0]"]
    before = settled_metrics(decode, step=True)
    block = int(sample_label(before, "vllm:cache_config_info", "block_size") or 0)
    body = json.dumps({**COMPLETION, "prompt": prompts}).encode()
    status, reply_headers, _ = raw_post(run.proxy_url, "/v1/completions", body, headers, timeout=300)
    deadline = time.monotonic() + settle_s
    while True:
        problems = kv_moved_problems(before, get_text(decode + "/metrics"), "socket", tokens, block)
        if not problems or time.monotonic() > deadline:
            return status, reply_headers, problems
        time.sleep(0.5)


def idle_strangers(port: int, count: int, source: str = "127.0.0.2") -> list[socket.socket]:
    """``count`` TCP connections to ``127.0.0.1:port`` from ``source`` that never say a word (closed
    by the caller); those the listener refused at once are closed already."""
    out = []
    for _ in range(count):
        s = socket.socket()
        s.bind((source, 0))
        try:
            s.connect(("127.0.0.1", port))
        except OSError:
            s.close()
            continue
        out.append(s)
    return out
