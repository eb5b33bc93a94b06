"""Real vLLM CPU engines handing KV over the socket connector (1P1D on loopback).

The engines start once per module: P (kv_producer, core 0, lease 6 s) and D
(kv_consumer, core 1, kv_load_failure_policy recompute, I/O timeout 5 s, peers:
P's listener), both without prefix caching so the decode engine's own request
(no kv_transfer_params) is a colocated reference computed locally on the same
weights. The handoff is done by hand as the proxy does it: P with
``do_remote_decode`` and ``max_tokens: 1``, then D with P's
``kv_transfer_params`` verbatim. The last test kills P.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import socket
import time
from collections.abc import Iterator

import aiohttp
import psutil
import pytest

from disagg.modelgen import build_model
from harness.ports import free_port
from harness.vllm_pair import Engine, metric, start_engine, wait_healthy

pytestmark = pytest.mark.e2e

MODULE = "disagg_connectors.socket_connector"
LEASE_S = 6
IO_TIMEOUT_S = 5
SHORT = "The quick brown fox jumps over the lazy dog. "
LONG = " ".join(f"Item {i}: the river carries stones, songs and {i % 7} old boats." for i in range(50))
#: the engines' arguments: no torch.compile, as every engine of the e2e tests (harness.engines.ENGINE_ARGS);
#: compiling costs each bring-up of this pair about 15 s and changes none of its answers
PAIR_ARGS = ["-O0"]
REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}


def kv_config(role: str, extra: dict) -> dict:
    cfg = {"kv_connector": "SocketKVConnector", "kv_connector_module_path": MODULE, "kv_role": role,
           "kv_connector_extra_config": extra}
    if role == "kv_consumer":
        cfg["kv_load_failure_policy"] = "recompute"
    return cfg


@pytest.fixture(scope="module")
def pair(engine_lock: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, Engine]]:
    """P and D engines sharing a fresh secret; both process groups killed at the end.

    ``engine_lock`` (tests/e2e/conftest.py) holds the machine-wide engine lock:
    run this module with plain pytest, not under an outer ``flock``.
    """
    root = tmp_path_factory.mktemp("socket-e2e")
    model = root / "tiny"
    build_model("tiny", model)
    secret = secrets.token_hex(32)
    kv_port = free_port()
    env = {"DISAGG_KV_SECRET": secret}
    engines: list[Engine] = []
    try:
        p = start_engine("prefill", str(model), 0,
                         kv_config("kv_producer", {"host": "127.0.0.1", "port": kv_port, "kv_lease_duration": LEASE_S}),
                         env, root, args=PAIR_ARGS)
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
                   kv_params: dict | None = None) -> dict:
    body: dict = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                  "ignore_eos": True}
    if kv_params is not None:
        body["kv_transfer_params"] = kv_params
    async with session.post(eng.url + "/v1/completions", json=body,
                            timeout=aiohttp.ClientTimeout(total=120)) as r:
        data = await r.json()
        assert r.status == 200, f"{eng.name}: HTTP {r.status}: {data}\n{eng.log_tail()}"
        return data


async def handoff(session: aiohttp.ClientSession, p: Engine, d: Engine, prompt: str,
                  max_tokens: int) -> tuple[dict, dict]:
    """Prefill on P (max_tokens 1), then decode on D with P's kv_transfer_params verbatim."""
    pre = await complete(session, p, prompt, 1, dict(REMOTE_DECODE))
    params = pre.get("kv_transfer_params")
    assert params and params.get("do_remote_prefill"), f"P returned no handoff params: {pre}"
    dec = await complete(session, d, prompt, max_tokens, params)
    return pre, dec


async def wait_for(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.5)


@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["short", "long"])
async def test_decode_matches_colocated_without_recompute(pair: tuple[Engine, Engine], prompt: str) -> None:
    p, d = pair
    async with aiohttp.ClientSession() as session:
        reference = await complete(session, d, prompt, 16)
        ext_before = metric(d.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
        local_before = metric(d.url, "vllm:prompt_tokens_by_source_total", source="local_compute")
        bytes_before = metric(d.url, "vllm:socket_kv_bytes_received_total")
        _, dec = await handoff(session, p, d, prompt, 16)
    n_prompt = reference["usage"]["prompt_tokens"]
    if prompt is LONG:
        assert 1000 <= n_prompt <= 2500, n_prompt
    assert dec["choices"][0]["text"] == reference["choices"][0]["text"]
    # D loaded the prompt (all but the last token, which vLLM recomputes) over the socket.
    ext = metric(d.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") - ext_before
    local = metric(d.url, "vllm:prompt_tokens_by_source_total", source="local_compute") - local_before
    assert ext >= n_prompt - 1 and local <= 1, (ext, local, n_prompt)
    kv_bytes = metric(d.url, "vllm:socket_kv_bytes_received_total") - bytes_before
    assert kv_bytes >= n_prompt * 1024, kv_bytes  # tiny model: 1 KiB of KV per token
    # D released the lease: P's KV usage returns to idle well before the lease ends.
    await wait_for(lambda: metric(p.url, "vllm:kv_cache_usage_perc") == 0, LEASE_S - 2, "P to free the blocks")


async def test_lease_expiry_frees_blocks(pair: tuple[Engine, Engine]) -> None:
    p, _ = pair
    expired_before = metric(p.url, "vllm:socket_kv_expired_reqs_total")
    async with aiohttp.ClientSession() as session:
        await complete(session, p, LONG, 1, dict(REMOTE_DECODE))
    assert metric(p.url, "vllm:kv_cache_usage_perc") > 0, "P should hold the blocks for the decode side"
    await wait_for(lambda: metric(p.url, "vllm:kv_cache_usage_perc") == 0, LEASE_S + 10, "the lease to expire")
    await wait_for(lambda: metric(p.url, "vllm:socket_kv_expired_reqs_total") == expired_before + 1, 10,
                   "the expiry to be counted")


async def test_wrong_secret_and_unknown_request_are_refused(pair: tuple[Engine, Engine]) -> None:
    from disagg_connectors.socket_connector.auth import AuthError, client_handshake, listener_id
    from disagg_connectors.socket_connector.wire import recv_frame, send_frame

    p, _ = pair
    port, secret = p.extra["kv_port"], p.extra["secret"]
    refused_before = metric(p.url, "vllm:socket_kv_refused_total")
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s, pytest.raises(AuthError):
        client_handshake(s, b"not-the-secret-at-all-000000000000", listener_id("127.0.0.1", port))
    # Right secret, but a request P never leased.
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        client_handshake(s, secret.encode(), listener_id("127.0.0.1", port))
        assert recv_frame(s)["ok"]
        send_frame(s, {"op": "fetch", "request_id": "no-such-request", "block_ids": [0, 1], "blocks_per_message": 8})
        reply = recv_frame(s)
    assert reply["ok"] is False and "no-such-request" in reply["error"]
    # Connector stats reach /metrics with the engine's next step: make one.
    async with aiohttp.ClientSession() as session:
        await complete(session, p, SHORT, 1)
    await wait_for(lambda: metric(p.url, "vllm:socket_kv_refused_total") >= refused_before + 2, 10,
                   "refusals to be counted")
    assert "refused unauthenticated connection" in p.log_path.read_text(errors="replace")


def decline_lines(eng: Engine) -> list[str]:
    return [line for line in eng.log_path.read_text(errors="replace").splitlines()
            if "declining kv_transfer_params" in line]


async def test_crafted_kv_transfer_params_are_declined_and_computed_locally(pair: tuple[Engine, Engine]) -> None:
    """Params sent straight to D's /v1/completions (no proxy): each bad one is declined with one log line,
    D computes the prompt itself (same greedy text, nothing fetched) and stays healthy."""
    p, d = pair
    async with aiohttp.ClientSession() as session:
        reference = await complete(session, d, SHORT, 8)
        pre = await complete(session, p, SHORT, 1, dict(REMOTE_DECODE))
        genuine = pre["kv_transfer_params"]
        blocks = genuine["remote_block_ids"]
        crafted = [  # (field the decline line must name, change to P's genuine params)
            ("remote_port", {"remote_port": "not-a-port"}),
            ("remote_host", {"remote_host": "198.18.0.1"}),  # not among D's peers: never dialled
            ("remote_block_ids", {"remote_block_ids": blocks + list(range(100000, 100010))}),
            ("remote_block_ids", {"remote_block_ids": [-1 - b for b in blocks]}),
            ("remote_block_ids", {"remote_block_ids": [str(b) for b in blocks]}),
            ("do_remote_prefill", {"do_remote_prefill": "yes"}),
            ("tp_size", {"tp_size": 10**9}),
        ]
        ext_before = metric(d.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
        xfers_before = metric(d.url, "vllm:socket_kv_transfers_total")
        failed_before = metric(d.url, "vllm:socket_kv_failed_transfers_total")
        started = time.monotonic()
        for field, change in crafted:
            seen = len(decline_lines(d))
            dec = await complete(session, d, SHORT, 8, {**genuine, **change})  # asserts HTTP 200
            assert dec["choices"][0]["text"] == reference["choices"][0]["text"], field
            await wait_for(lambda s=seen: len(decline_lines(d)) > s, 10, f"D to log the decline of {field}")
            await asyncio.sleep(0.3)  # would a second line follow?
            new = decline_lines(d)[seen:]
            assert len(new) == 1 and field in new[0], (field, new)
            assert "remote_request_id" not in new[0] and len(new[0]) < 600  # the field, not the whole dict
        elapsed = time.monotonic() - started
        assert elapsed < 30, elapsed
        # Nothing was fetched for them: no transfer, no failed transfer, no external prompt tokens.
        assert metric(d.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == ext_before
        assert metric(d.url, "vllm:socket_kv_transfers_total") == xfers_before
        assert metric(d.url, "vllm:socket_kv_failed_transfers_total") == failed_before
        # D is healthy and still fetches: the genuine params, after all that, are served over the socket.
        assert d.alive()
        async with session.get(d.url + "/health") as r:
            assert r.status == 200
        # Fresh params: the first genuine lease (LEASE_S) may have run out during the loop on a loaded
        # machine (CI saw it: D then recomputed, rightly, and the counter did not move).
        fresh = (await complete(session, p, SHORT, 1, dict(REMOTE_DECODE)))["kv_transfer_params"]
        dec = await complete(session, d, SHORT, 8, fresh)
        assert dec["choices"][0]["text"] == reference["choices"][0]["text"]
        assert metric(d.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") > ext_before
        assert metric(d.url, "vllm:socket_kv_failed_transfers_total") == failed_before
        # The fresh lease is released by the fetch; the first one, never fetched, expires.
        await wait_for(lambda: metric(p.url, "vllm:kv_cache_usage_perc") == 0, LEASE_S + 10, "P to free the blocks")
        # P, asked for a remote decode with a flag that is not a bool, serves the request without a lease.
        seen = len(decline_lines(p))
        plain = await complete(session, p, SHORT, 1, {**REMOTE_DECODE, "do_remote_decode": "yes"})
        assert not plain.get("kv_transfer_params")
        await wait_for(lambda: len(decline_lines(p)) == seen + 1, 10, "P to log the decline")
        assert "do_remote_decode" in decline_lines(p)[-1]
        # No blocks held for anyone (a lease would hold them for LEASE_S).
        await wait_for(lambda: metric(p.url, "vllm:kv_cache_usage_perc") == 0, LEASE_S / 2, "P to hold nothing")
    assert p.alive() and d.alive()


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


async def test_frozen_prefill_times_out_to_local_recompute_without_leaking(pair: tuple[Engine, Engine]) -> None:
    """P stops answering (SIGSTOP) after the prefill: D gives up after its I/O timeout and recomputes."""
    p, d = pair
    async with aiohttp.ClientSession() as session:
        reference = await complete(session, d, LONG, 8)
        failed_before = metric(d.url, "vllm:socket_kv_failed_transfers_total")
        pre = await complete(session, p, LONG, 1, dict(REMOTE_DECODE))
        try:
            stop_group(p.proc.pid)
            started = time.monotonic()
            dec = await complete(session, d, LONG, 8, pre["kv_transfer_params"])
            elapsed = time.monotonic() - started
        finally:
            os.killpg(p.proc.pid, signal.SIGCONT)
    assert dec["choices"][0]["text"] == reference["choices"][0]["text"]
    assert IO_TIMEOUT_S <= elapsed < IO_TIMEOUT_S + 30, elapsed
    assert metric(d.url, "vllm:socket_kv_failed_transfers_total") == failed_before + 1
    # P frees the blocks (D's late release or the lease), nothing leaks.
    await wait_for(lambda: metric(p.url, "vllm:kv_cache_usage_perc") == 0, LEASE_S + 20, "P to free the blocks")


async def test_prefill_killed_leads_to_local_recompute(pair: tuple[Engine, Engine]) -> None:
    """Runs last: P dies after the prefill; D must recompute locally, not hang."""
    p, d = pair
    async with aiohttp.ClientSession() as session:
        reference = await complete(session, d, LONG, 8)
        failed_before = metric(d.url, "vllm:socket_kv_failed_transfers_total")
        pre = await complete(session, p, LONG, 1, dict(REMOTE_DECODE))
        p.stop()
        started = time.monotonic()
        dec = await complete(session, d, LONG, 8, pre["kv_transfer_params"])
        elapsed = time.monotonic() - started
    assert dec["choices"][0]["text"] == reference["choices"][0]["text"]
    assert elapsed < 60, elapsed
    assert metric(d.url, "vllm:socket_kv_failed_transfers_total") == failed_before + 1
    assert d.alive()

