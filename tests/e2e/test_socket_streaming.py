"""Streamed transfers of the socket connector on real vLLM CPU engines (1P1D on loopback, by hand).

The proxy's streaming handoff (``connector: {type: socket, streaming: true}``) sends the prefill
engine P and the decode engine D their requests at once, joined by a ``stream_key``; D's connector
connects to P's listener as soon as its blocks are allocated and receives each layer's KV as P's
forward writes it. This module does what the proxy does, by hand, to reach every failure path.

P runs with prefix caching on and a 256-token step budget, so a long prompt is prefilled chunk by
chunk (the stream follows each chunk) and a repeated prompt comes from P's prefix cache (blocks no
forward writes); D runs without prefix caching, so its own answer to a plain request is the
colocated reference. Handoffs are checked as everywhere: D's greedy text equals the reference AND
D's counters show the prompt's KV arrived over the socket.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import time
from collections.abc import Iterator

import aiohttp
import pytest

from disagg.modelgen import build_model
from harness.ports import free_port
from harness.vllm_pair import Engine, metric, start_engine, wait_healthy
from tests.e2e.test_socket_connector import LONG, PAIR_ARGS, SHORT, complete, kv_config, wait_for

pytestmark = pytest.mark.e2e

LEASE_S = 6
IO_TIMEOUT_S = 8
STREAM_WAIT_S = 3
#: P's step budget: a LONG prompt (1,000-2,500 tokens) takes several steps
CHUNK_TOKENS = 256
#: a prompt whose prefill takes P dozens of steps (a few hundred ms here), long enough to cut it short
HUGE = " ".join([LONG] * 5)


def huge() -> str:
    """HUGE with a fresh beginning: nothing of it is in P's prefix cache, so P computes it all."""
    return f"Run {secrets.token_hex(4)}. {HUGE}"


#: what P's listener logs when a stream has sent every layer
STREAM_COMPLETED = "socket KV connector: streamed "
#: how long after sending both requests a test cuts one short (P is then mid-prompt)
CUT_AFTER_S = 0.15


@pytest.fixture(scope="module")
def pair(engine_lock: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, Engine]]:
    root = tmp_path_factory.mktemp("socket-stream-e2e")
    model = root / "tiny"
    build_model("tiny", model)
    secret = secrets.token_hex(32)
    kv_port = free_port()
    env = {"DISAGG_KV_SECRET": secret}
    engines: list[Engine] = []
    try:
        p = start_engine("prefill", str(model), 0,
                         kv_config("kv_producer", {"host": "127.0.0.1", "port": kv_port, "kv_lease_duration": LEASE_S,
                                                   "stream_wait_s": STREAM_WAIT_S}),
                         env, root, prefix_caching=True,
                         args=[*PAIR_ARGS, "--max-num-batched-tokens", str(CHUNK_TOKENS)])
        p.extra.update(kv_port=kv_port, secret=secret)
        engines.append(p)
        d_extra = {"io_timeout_s": IO_TIMEOUT_S, "peers": [f"127.0.0.1:{kv_port}"]}
        d = start_engine("decode", str(model), 1, kv_config("kv_consumer", d_extra), env, root, args=PAIR_ARGS)
        engines.append(d)
        wait_healthy(engines)
        yield p, d
    finally:
        for eng in engines:
            eng.stop()


def stream_params(p: Engine) -> tuple[dict, dict]:
    """(P's, D's) kv_transfer_params for one streamed handoff, as the proxy builds them."""
    key = secrets.token_urlsafe(24)
    return ({"do_remote_decode": True, "do_remote_prefill": False, "stream_key": key},
            {"do_remote_prefill": True, "do_remote_decode": False, "transfer": "socket", "stream_key": key,
             "remote_host": "127.0.0.1", "remote_port": p.extra["kv_port"]})


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


async def streamed(session: aiohttp.ClientSession, p: Engine, d: Engine, prompt: str, max_tokens: int) -> dict:
    """P and D at once, as the proxy's streaming handoff does; D's reply."""
    p_params, d_params = stream_params(p)
    _, dec = await asyncio.gather(complete(session, p, prompt, 1, p_params),
                                  complete(session, d, prompt, max_tokens, d_params))
    return dec


def log_lines(eng: Engine, needle: str) -> list[str]:
    return [line for line in eng.log_path.read_text(errors="replace").splitlines() if needle in line]


@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["short", "long"])
async def test_a_streamed_handoff_answers_like_one_engine_and_moves_the_kv(pair: tuple[Engine, Engine],
                                                                          prompt: str) -> None:
    p, d = pair
    async with aiohttp.ClientSession() as session:
        reference = await complete(session, d, prompt, 16)
        counters = Counters(d)
        streams_before = len(log_lines(p, "socket KV connector: streamed"))
        dec = await streamed(session, p, d, prompt, 16)
    n = reference["usage"]["prompt_tokens"]
    assert dec["choices"][0]["text"] == reference["choices"][0]["text"]
    assert dec["usage"] == reference["usage"] and dec["choices"][0]["finish_reason"] == "length"
    moved = counters.delta()
    assert moved["ext"] >= n - 1 and moved["local"] <= 1 and moved["failed"] == 0, moved
    assert moved["bytes"] >= (n - 1) * 1024, moved        # tiny model: 1 KiB of KV per token
    assert len(log_lines(p, "socket KV connector: streamed")) == streams_before + 1
    # The stream's end freed P's blocks: no lease waits for a release.
    await wait_for(lambda: metric(p.url, "vllm:kv_cache_usage_perc") == 0, LEASE_S - 2, "P to free the blocks")


async def test_a_prompt_prefilled_chunk_by_chunk_and_then_from_the_prefix_cache_streams_whole(
        pair: tuple[Engine, Engine]) -> None:
    """LONG takes several of P's 256-token steps (the stream follows each); sent again, P serves
    every full block from its prefix cache, which no forward writes: they must arrive all the same."""
    p, d = pair
    async with aiohttp.ClientSession() as session:
        reference = await complete(session, d, LONG, 8)
        n = reference["usage"]["prompt_tokens"]
        assert n > 3 * CHUNK_TOKENS, n
        hits_before = metric(p.url, "vllm:prefix_cache_hits_total")
        for attempt in ("computed", "cached"):
            counters = Counters(d)
            dec = await streamed(session, p, d, LONG, 8)
            moved = counters.delta()
            assert dec["choices"][0]["text"] == reference["choices"][0]["text"], attempt
            assert moved["ext"] >= n - 1 and moved["failed"] == 0, (attempt, moved)
    assert metric(p.url, "vllm:prefix_cache_hits_total") - hits_before >= n - 2 * 16, "P's second prefill hit its cache"


async def test_a_key_the_prefill_engine_never_sees_is_recomputed_after_the_wait(pair: tuple[Engine, Engine]) -> None:
    """P never got its request (the proxy's prefill failed before it reached P): D waits
    ``stream_wait_s`` for it, then computes the prompt itself."""
    p, d = pair
    async with aiohttp.ClientSession() as session:
        reference = await complete(session, d, SHORT, 8)
        counters = Counters(d)
        started = time.monotonic()
        dec = await complete(session, d, SHORT, 8, stream_params(p)[1])
        elapsed = time.monotonic() - started
    assert dec["choices"][0]["text"] == reference["choices"][0]["text"]
    assert counters.delta()["failed"] == 1
    assert STREAM_WAIT_S <= elapsed < STREAM_WAIT_S + 10, elapsed


async def test_a_prefill_reaching_a_key_after_decode_gave_up_holds_no_lease(pair: tuple[Engine, Engine]) -> None:
    """D waited ``stream_wait_s`` for P (whose queue was long), then computed the prompt itself. When
    P reaches the request, its listener remembers the abandoned key: P answers and frees the blocks
    at once, instead of holding them for the lease (LEASE_S) for a reader that never comes."""
    p, d = pair
    async with aiohttp.ClientSession() as session:
        reference = await complete(session, d, LONG, 8)
        p_params, d_params = stream_params(p)
        counters = Counters(d)
        dec = await complete(session, d, LONG, 8, d_params)      # P has not got it yet: D gives up
        assert dec["choices"][0]["text"] == reference["choices"][0]["text"]
        assert counters.delta()["failed"] == 1
        expired_before = metric(p.url, "vllm:socket_kv_expired_reqs_total")
        started = time.monotonic()
        await complete(session, p, LONG, 1, p_params)            # P reaches it late
        await wait_for(lambda: metric(p.url, "vllm:kv_cache_usage_perc") == 0, LEASE_S - 3, "P to free the blocks")
    assert time.monotonic() - started < LEASE_S, "P held the blocks for the lease"
    assert metric(p.url, "vllm:socket_kv_expired_reqs_total") == expired_before


async def test_a_prefill_request_aborted_mid_stream_ends_it_and_decode_recomputes(pair: tuple[Engine, Engine]) -> None:
    p, d = pair
    prompt = huge()
    async with aiohttp.ClientSession() as session:
        reference = await complete(session, d, prompt, 8)
        assert reference["usage"]["prompt_tokens"] > 20 * CHUNK_TOKENS
        counters = Counters(d)
        p_params, d_params = stream_params(p)
        decode = asyncio.create_task(complete(session, d, prompt, 8, d_params))
        prefill = asyncio.create_task(complete(session, p, prompt, 1, p_params))
        await asyncio.sleep(CUT_AFTER_S)
        assert not prefill.done(), "P finished before it could be cut short"
        prefill.cancel()                         # the client left: aiohttp closes P's connection, vLLM aborts
        dec = await decode
    assert dec["choices"][0]["text"] == reference["choices"][0]["text"]
    assert counters.delta()["failed"] == 1
    await wait_for(lambda: metric(p.url, "vllm:kv_cache_usage_perc") == 0, 10, "P to free the blocks")
    # the stream ended with the abort (or, had P not scheduled it yet, was never opened)
    assert log_lines(p, "ended after") or log_lines(p, "no stream"), "P's listener never saw the stream end"


async def test_a_decode_request_aborted_mid_stream_frees_both_sides(pair: tuple[Engine, Engine]) -> None:
    p, d = pair
    prompt = huge()
    async with aiohttp.ClientSession() as session:
        p_params, d_params = stream_params(p)
        decode = asyncio.create_task(complete(session, d, prompt, 64, d_params))
        prefill = asyncio.create_task(complete(session, p, prompt, 1, p_params))
        await asyncio.sleep(CUT_AFTER_S)
        decode.cancel()
        await prefill                            # P finishes its prefill; the cut stream frees it
    await wait_for(lambda: metric(d.url, "vllm:kv_cache_usage_perc") == 0, IO_TIMEOUT_S + 5, "D to free its blocks")
    # P frees at once when the cut stream had begun, else when its lease expires.
    await wait_for(lambda: metric(p.url, "vllm:kv_cache_usage_perc") == 0, LEASE_S + 10, "P to free its blocks")
    assert p.alive() and d.alive()


async def test_a_lease_nobody_streams_expires(pair: tuple[Engine, Engine]) -> None:
    p, _ = pair
    expired_before = metric(p.url, "vllm:socket_kv_expired_reqs_total")
    async with aiohttp.ClientSession() as session:
        await complete(session, p, LONG, 1, stream_params(p)[0])
    assert metric(p.url, "vllm:kv_cache_usage_perc") > 0, "P should hold the blocks for the stream"
    await wait_for(lambda: metric(p.url, "vllm:kv_cache_usage_perc") == 0, LEASE_S + 10, "the lease to expire")
    await wait_for(lambda: metric(p.url, "vllm:socket_kv_expired_reqs_total") == expired_before + 1, 10,
                   "the expiry to be counted")


async def test_a_frozen_prefill_mid_stream_times_out_to_local_recompute(pair: tuple[Engine, Engine]) -> None:
    """P stops (SIGSTOP) while streaming: D gives up after its I/O timeout and recomputes; once P runs
    again it finds the stream's reader gone and frees the blocks."""
    from tests.e2e.test_socket_connector import stop_group

    p, d = pair
    prompt = huge()
    async with aiohttp.ClientSession() as session:
        reference = await complete(session, d, prompt, 8)
        counters = Counters(d)
        completed_before = len(log_lines(p, STREAM_COMPLETED))
        p_params, d_params = stream_params(p)
        decode = asyncio.create_task(complete(session, d, prompt, 8, d_params))
        prefill = asyncio.create_task(complete(session, p, prompt, 1, p_params))
        await asyncio.sleep(CUT_AFTER_S)
        assert not prefill.done(), "P finished before it could be frozen"
        await asyncio.to_thread(stop_group, p.proc.pid)
        try:
            started = time.monotonic()
            dec = await decode
            elapsed = time.monotonic() - started
        finally:
            os.killpg(p.proc.pid, signal.SIGCONT)
        await prefill
    # the premise: P had not sent the whole stream when it froze (else D had every layer in time)
    assert len(log_lines(p, STREAM_COMPLETED)) == completed_before, "P completed the stream before it froze"
    assert dec["choices"][0]["text"] == reference["choices"][0]["text"]
    # the failure reaches /metrics with the engine core's stats, which may trail the reply
    await wait_for(lambda: counters.delta()["failed"] == 1, 10, "D to count the failed stream")
    assert IO_TIMEOUT_S - 1 <= elapsed < IO_TIMEOUT_S + 30, elapsed
    await wait_for(lambda: metric(p.url, "vllm:kv_cache_usage_perc") == 0, LEASE_S + 10, "P to free the blocks")


async def test_prefill_killed_mid_stream_leads_to_local_recompute(pair: tuple[Engine, Engine]) -> None:
    """Runs last: P dies while streaming; D recomputes, no hang."""
    p, d = pair
    prompt = huge()
    async with aiohttp.ClientSession() as session:
        reference = await complete(session, d, prompt, 8)
        counters = Counters(d)
        completed_before = len(log_lines(p, STREAM_COMPLETED))
        p_params, d_params = stream_params(p)
        decode = asyncio.create_task(complete(session, d, prompt, 8, d_params))
        prefill = asyncio.create_task(complete(session, p, prompt, 1, p_params))
        await asyncio.sleep(CUT_AFTER_S)
        assert not prefill.done(), "P finished before it could be killed"
        await asyncio.to_thread(p.stop)
        started = time.monotonic()
        dec = await decode
        elapsed = time.monotonic() - started
        prefill.cancel()
    # the premise: P had not sent the whole stream when it died (else D had every layer and nothing failed)
    assert len(log_lines(p, STREAM_COMPLETED)) == completed_before, "P completed the stream before it died"
    assert dec["choices"][0]["text"] == reference["choices"][0]["text"]
    # the failure reaches /metrics with the engine core's stats, which may trail the reply
    try:
        await wait_for(lambda: counters.delta()["failed"] == 1, 10, "D to count the failed stream")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; D's counters moved by {counters.delta()}") from None
    assert elapsed < 30, elapsed
    assert d.alive()
