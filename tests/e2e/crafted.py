"""Crafted inputs: requests meant to hurt an engine, and what must happen to each.

Each :class:`Crafted` case is sent to the proxy, and straight to every engine of
a deployment (without the engine key, as anyone on the LAN could, and, for the
socket connector, with it, as a stand-in for a client that got past the key).
Required: a clear answer within the case's timeout (a 4xx, or 200 where the
request is valid once the proxy stripped what it must: then the transfer was
declined), never a 5xx from the proxy, and every engine alive and idle
afterwards. Used by tests/e2e/test_nixl_crafted_inputs.py (NIXL) and
tests/e2e/test_socket_conformance.py (socket connector).
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
from dataclasses import dataclass, field

from disagg.prometheus_text import sample_sum
from harness.engines import get_text

#: a kv_transfer_params that would make a decode engine fetch from an address of the attacker's
EVIL_KV = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "evil",
           "remote_block_ids": [0, 1, 2], "remote_request_id": "cmpl-evil-0", "remote_host": "198.18.0.1",
           "remote_port": 5601, "tp_size": 1}


@dataclass(frozen=True)
class Crafted:
    """One hostile request: ``raw`` bytes to ``path``; the statuses the proxy may answer."""

    name: str
    path: str
    raw: bytes
    proxy_status: frozenset[int]
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=dict)
    timeout: float = 60.0
    #: what an engine answers without the engine key (0: it closed the connection)
    engine_status: frozenset[int] = frozenset({401})


def _body(**fields: object) -> bytes:
    return json.dumps({"model": "tiny", "prompt": "The river runs past the mill and", "max_tokens": 4,
                       "temperature": 0, **fields}).encode()


OK = frozenset({200})
BAD = frozenset({400})


def cases() -> list[Crafted]:
    """The crafted-input list (at least 20 cases)."""
    kv = EVIL_KV
    return [
        Crafted("kv-port-not-a-port", "/v1/completions", _body(kv_transfer_params={**kv, "remote_port": "x"}), OK),
        Crafted("kv-foreign-host", "/v1/completions", _body(kv_transfer_params=kv), OK),
        Crafted("kv-as-string", "/v1/completions", _body(kv_transfer_params="do_remote_prefill"), OK | BAD),
        Crafted("kv-in-vllm-xargs", "/v1/completions", _body(vllm_xargs={"kv_transfer_params": "x"}), OK),
        Crafted("kv-huge-block-list", "/v1/completions",
                _body(kv_transfer_params={**kv, "remote_block_ids": list(range(200_000))}), OK),
        Crafted("kv-negative-blocks", "/v1/completions",
                _body(kv_transfer_params={**kv, "remote_block_ids": [-1, -2]}), OK),
        Crafted("kv-do-remote-decode", "/v1/completions",
                _body(kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": "yes"}), OK),
        Crafted("kv-huge-tp-size", "/v1/completions", _body(kv_transfer_params={**kv, "tp_size": 10**9}), OK),
        Crafted("kv-chat", "/v1/chat/completions",
                json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                            "kv_transfer_params": kv}).encode(), OK),
        Crafted("kv-responses", "/v1/responses",
                json.dumps({"model": "tiny", "input": "hi", "max_output_tokens": 4,
                            "kv_transfer_params": kv}).encode(), OK | BAD),
        Crafted("invocations", "/invocations", _body(kv_transfer_params=kv), OK | BAD | frozenset({404})),
        Crafted("huge-n", "/v1/completions", _body(n=100_000), BAD),
        Crafted("huge-prompt-list", "/v1/completions",
                json.dumps({"model": "tiny", "prompt": [[5]] * 100_000, "max_tokens": 1,
                            "n": 1, "echo": True, "logprobs": 1000}).encode(), BAD),
        Crafted("out-of-vocab-ids", "/v1/completions", _body(prompt=[10**9, 3]), BAD),
        Crafted("negative-token-id", "/v1/completions", _body(prompt=[-5, 3]), BAD),
        Crafted("over-context", "/v1/completions", _body(prompt=[5] * 9000), BAD),
        Crafted("deeply-nested", "/v1/completions",
                b'{"model":"tiny","prompt":"x","extra":' + b"[" * 100_000 + b"]" * 100_000 + b"}", BAD),
        Crafted("malformed-json", "/v1/completions", b'{"model": "tiny", "prompt": ', BAD),
        Crafted("empty-body", "/v1/completions", b"", BAD),
        Crafted("oversized-body", "/v1/completions", _body(padding="x" * (65 * 1024 * 1024)),
                frozenset({413}), engine_status=frozenset({0, 401, 413})),
        Crafted("oversized-header", "/v1/completions", _body(), frozenset({400, 431}),
                headers={"X-Junk": "y" * 70_000}, engine_status=frozenset({0, 400, 401, 431})),
        Crafted("logprobs-too-many", "/v1/completions", _body(logprobs=100_000), BAD),
        Crafted("negative-max-tokens", "/v1/completions", _body(max_tokens=-1), BAD),
        Crafted("options-with-body", "/v1/completions", _body(kv_transfer_params=kv), frozenset({405}),
                method="OPTIONS", engine_status=frozenset({405})),
    ]


@dataclass
class Answer:
    status: int            # 0: the server closed the connection without a status line
    seconds: float
    body: bytes


def send(base_url: str, case: Crafted, key: str | None = None) -> Answer:
    """Send ``case`` with http.client (raw bytes, any header), within ``case.timeout``."""
    url = urllib.parse.urlsplit(base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=case.timeout)
    headers = {"Content-Type": "application/json", **case.headers}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    started = time.monotonic()
    try:
        conn.request(case.method, case.path, body=case.raw, headers=headers)
        resp = conn.getresponse()
        return Answer(resp.status, time.monotonic() - started, resp.read())
    except (ConnectionError, http.client.RemoteDisconnected, BrokenPipeError):
        return Answer(0, time.monotonic() - started, b"")
    except TimeoutError as exc:
        raise AssertionError(f"{case.name}: no answer from {base_url} within {case.timeout} s") from exc
    finally:
        conn.close()


def engines_idle_and_alive(engines: dict[str, str], timeout: float = 60) -> list[str]:
    """Problems left on the engines: not healthy, or requests still running or waiting."""
    deadline = time.monotonic() + timeout
    while True:
        problems = []
        for name, url in engines.items():
            try:
                get_text(url + "/health", timeout=10)
                metrics = get_text(url + "/metrics", timeout=10)
            except OSError as exc:
                problems.append(f"{name}: not answering ({exc})")
                continue
            busy = sample_sum(metrics, "vllm:num_requests_running") + sample_sum(metrics, "vllm:num_requests_waiting")
            if busy:
                problems.append(f"{name}: {busy:.0f} requests still running or waiting")
        if not problems or time.monotonic() > deadline:
            return problems
        time.sleep(0.5)
