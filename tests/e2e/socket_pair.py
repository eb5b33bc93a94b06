"""One pair of real vLLM CPU engines with the socket connector, started by hand (no `disagg up`).

tests/e2e/test_socket_connector.py starts it once (:func:`start_pair`) and drives both transfer
modes over it the way the proxy does, by hand, to reach every failure path: pulled (P prefills
with ``do_remote_decode`` and ``max_tokens: 1`` and leases the blocks, then D fetches them with P's
``kv_transfer_params`` verbatim, :func:`handoff`) and streamed (P and D get their requests at once,
joined by a ``stream_key``, and P sends each layer's KV as its forward writes it, :func:`streamed`).

The settings serve both modes; each is read only by the tests that say so:

- P (kv_producer, core 0): lease :data:`LEASE_S`; ``stream_wait_s`` :data:`STREAM_WAIT_S` (how long
  its listener waits for a streamed request to be scheduled: only streamed handoffs read it);
  prefix caching on and a step budget of :data:`CHUNK_TOKENS` tokens, so a long prompt is prefilled
  chunk by chunk (a stream follows each chunk) and a repeated prompt comes from P's prefix cache (a
  pulled handoff reads the leased blocks whichever way they were filled); prefill held to at most
  :data:`PREFILL_RATE` tokens/s (the project's emulated prefill rate), so P is mid-prompt for a
  while on any machine.
- D (kv_consumer, core 1): ``kv_load_failure_policy: recompute``, I/O timeout :data:`IO_TIMEOUT_S`
  (bounds a fetch and a stream alike; above ``stream_wait_s``, as the connector's config asks),
  ``peers``: P's listener. Without prefix caching, so D's own answer to a plain request is the
  colocated reference computed locally on the same weights.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import psutil
from disagg_connectors.emulated_prefill import ENV as EMULATED_PREFILL_RATE_ENV

from disagg.modelgen import build_model
from disagg.prometheus_text import sample_label
from harness.ports import free_port
from harness.vllm_pair import Engine, metric, start_engine, wait_healthy

MODULE = "disagg_connectors.socket_connector"
#: seconds P keeps a finished request's blocks for D
LEASE_S = 6
#: D's socket I/O timeout: a frozen P is given up after this long (pulled or streamed)
IO_TIMEOUT_S = 5
#: P's wait for a streamed request to be scheduled before it refuses D's stream
STREAM_WAIT_S = 3
#: P's step budget: a LONG prompt (1,000-2,500 tokens) takes several steps
CHUNK_TOKENS = 256
#: P's prefill rate, tokens/s (connectors/emulated_prefill.py holds each of P's prefill steps to it):
#: a floor under P's prefill time, so that a test that cuts a streamed HUGE prompt short (more
#: than two seconds at this rate) finds P mid-prompt however fast the machine prefills natively
PREFILL_RATE = 2500
#: the engines' arguments: no torch.compile, as every engine of the e2e tests (harness.engines.ENGINE_ARGS);
#: compiling costs each bring-up of the pair about 15 s and changes none of its answers
PAIR_ARGS = ["-O0"]

SHORT = "The quick brown fox jumps over the lazy dog. "
LONG = " ".join(f"Item {i}: the river carries stones, songs and {i % 7} old boats." for i in range(50))
#: a prompt whose prefill takes P dozens of steps (over two seconds at :data:`PREFILL_RATE`): long enough to cut short
HUGE = " ".join([LONG] * 5)

#: P's kv_transfer_params for a pulled handoff (as the proxy sends them)
REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}
#: what P's listener logs when a stream has sent every layer
STREAM_COMPLETED = "socket KV connector: streamed "


def fresh(prompt: str) -> str:
    """``prompt`` with a fresh beginning: none of its blocks is in P's prefix cache, so P computes it all."""
    return f"Run {secrets.token_hex(4)}. {prompt}"


def huge() -> str:
    """A fresh HUGE."""
    return fresh(HUGE)


def kv_config(role: str, extra: dict[str, Any]) -> dict[str, Any]:
    cfg: dict[str, Any] = {"kv_connector": "SocketKVConnector", "kv_connector_module_path": MODULE,
                           "kv_role": role, "kv_connector_extra_config": extra}
    if role == "kv_consumer":
        cfg["kv_load_failure_policy"] = "recompute"
    return cfg


@contextmanager
def start_pair(root: Path) -> Iterator[tuple[Engine, Engine]]:
    """P and D (the module docstring's settings) sharing a fresh secret, healthy; both process
    groups killed on exit. The caller holds the engine lock (the ``engine_lock`` fixture)."""
    model = root / "tiny"
    build_model("tiny", model)
    secret = secrets.token_hex(32)
    kv_port = free_port()
    env = {"DISAGG_KV_SECRET": secret}
    engines: list[Engine] = []
    try:
        p_extra = {"host": "127.0.0.1", "port": kv_port, "kv_lease_duration": LEASE_S, "stream_wait_s": STREAM_WAIT_S}
        p = start_engine("prefill", str(model), 0, kv_config("kv_producer", p_extra),
                         {**env, EMULATED_PREFILL_RATE_ENV: str(PREFILL_RATE)}, root,
                         prefix_caching=True, args=[*PAIR_ARGS, "--max-num-batched-tokens", str(CHUNK_TOKENS)])
        p.extra.update(kv_port=kv_port, secret=secret)
        engines.append(p)
        d_extra = {"streams": 2, "io_timeout_s": IO_TIMEOUT_S, "peers": [f"127.0.0.1:{kv_port}"]}
        d = start_engine("decode", str(model), 1, kv_config("kv_consumer", d_extra), env, root, args=PAIR_ARGS)
        engines.append(d)
        wait_healthy(engines)
        yield p, d
    finally:
        for eng in engines:
            eng.stop()


async def complete(session: aiohttp.ClientSession, eng: Engine, prompt: str, max_tokens: int,
                   kv_params: dict[str, Any] | None = None) -> dict[str, Any]:
    """One greedy completion on ``eng`` (HTTP 200 asserted, with the engine's log tail if not)."""
    body: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True}
    if kv_params is not None:
        body["kv_transfer_params"] = kv_params
    # a connection of its own: a kept-alive one that the engine closes as it is reused (its idle
    # timeout is 5 s) fails the request before it reaches the engine
    async with session.post(eng.url + "/v1/completions", json=body, headers={"Connection": "close"},
                            timeout=aiohttp.ClientTimeout(total=120)) as r:
        data: dict[str, Any] = await r.json()
        assert r.status == 200, f"{eng.name}: HTTP {r.status}: {data}\n{eng.log_tail()}"
        return data


async def handoff(session: aiohttp.ClientSession, p: Engine, d: Engine, prompt: str,
                  max_tokens: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """A pulled handoff: prefill on P (max_tokens 1), then decode on D with P's kv_transfer_params verbatim."""
    pre = await complete(session, p, prompt, 1, dict(REMOTE_DECODE))
    params = pre.get("kv_transfer_params")
    assert params and params.get("do_remote_prefill"), f"P returned no handoff params: {pre}"
    dec = await complete(session, d, prompt, max_tokens, params)
    return pre, dec


def stream_params(p: Engine) -> tuple[dict[str, Any], dict[str, Any]]:
    """(P's, D's) kv_transfer_params for one streamed handoff, as the proxy builds them."""
    key = secrets.token_urlsafe(24)
    return ({"do_remote_decode": True, "do_remote_prefill": False, "stream_key": key},
            {"do_remote_prefill": True, "do_remote_decode": False, "transfer": "socket", "stream_key": key,
             "remote_host": "127.0.0.1", "remote_port": p.extra["kv_port"]})


async def streamed(session: aiohttp.ClientSession, p: Engine, d: Engine, prompt: str,
                   max_tokens: int) -> dict[str, Any]:
    """A streamed handoff: P and D at once, as the proxy's streaming handoff does; D's reply."""
    p_params, d_params = stream_params(p)
    replies = await asyncio.gather(complete(session, p, prompt, 1, p_params),
                                   complete(session, d, prompt, max_tokens, d_params))
    return replies[1]


async def wait_for(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``cond`` every 0.5 s until it holds; AssertionError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.5)


def stop_group(pgid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP a process group and wait until every member is stopped (the signal lands
    asynchronously; on a loaded machine a member may still answer for a moment)."""
    os.killpg(pgid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while True:
        members = []
        for proc in psutil.process_iter():
            try:
                if os.getpgid(proc.pid) == pgid:
                    members.append(proc.status())
            except (psutil.Error, ProcessLookupError):
                continue
        if members and all(st == psutil.STATUS_STOPPED for st in members):
            return
        assert time.monotonic() < deadline, f"process group {pgid} not stopped: {members}"
        time.sleep(0.05)


def block_size(eng: Engine) -> int:
    """``eng``'s KV cache block size in tokens (vllm:cache_config_info; 128 on vLLM's CPU backend)."""
    with urllib.request.urlopen(eng.url + "/metrics", timeout=60) as r:
        size = sample_label(r.read().decode(), "vllm:cache_config_info", "block_size")
    assert size is not None, f"{eng.name} reports no vllm:cache_config_info block_size"
    return int(size)


def log_lines(eng: Engine, needle: str) -> list[str]:
    """The lines of ``eng``'s log that contain ``needle``."""
    return [line for line in eng.log_path.read_text(errors="replace").splitlines() if needle in line]


def decline_lines(eng: Engine) -> list[str]:
    """The connector's lines declining crafted kv_transfer_params in ``eng``'s log."""
    return log_lines(eng, "declining kv_transfer_params")


#: D's counters read around a handoff: name -> (metric, labels)
COUNTERS: dict[str, tuple[str, dict[str, str]]] = {
    "ext": ("vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"}),
    "local": ("vllm:prompt_tokens_by_source_total", {"source": "local_compute"}),
    "bytes": ("vllm:socket_kv_bytes_received_total", {}),
    "failed": ("vllm:socket_kv_failed_transfers_total", {})}


class Counters:
    """D's transfer counters around one handoff."""

    def __init__(self, d: Engine):
        self.d = d
        self.before = self._read()

    def _read(self) -> dict[str, float]:
        return {k: metric(self.d.url, name, **labels) for k, (name, labels) in COUNTERS.items()}

    def delta(self) -> dict[str, float]:
        now = self._read()
        return {k: now[k] - self.before[k] for k in now}
