"""Real vLLM CPU engines handing KV over the socket connector, pulled and streamed (1P1D on loopback, by hand).

One pair for the whole module (tests/e2e/socket_pair.py: its settings, and which tests read
each). Pulled handoffs are done as the proxy's fetching handoff does them, streamed ones as its
streaming handoff does (P and D at once, joined by a ``stream_key``), by hand, to reach every
failure path. Handoffs are checked as everywhere: D's greedy text equals D's own answer to the
plain request (the colocated reference) AND D's counters show the prompt's KV arrived over the
socket.

Order: the tests that leave P as it was first; then those that freeze P (SIGSTOP, then SIGCONT),
pulled and streamed; last the one test that kills P, mid-stream and with a pulled lease
outstanding.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import aiohttp
import pytest

from harness.vllm_pair import Engine, metric
from tests.e2e.socket_pair import (
    CHUNK_TOKENS,
    IO_TIMEOUT_S,
    LEASE_S,
    LONG,
    REMOTE_DECODE,
    SHORT,
    STREAM_COMPLETED,
    STREAM_WAIT_S,
    Counters,
    block_size,
    complete,
    decline_lines,
    fresh,
    handoff,
    huge,
    log_lines,
    start_pair,
    stop_group,
    stream_params,
    streamed,
    wait_for,
)

pytestmark = pytest.mark.e2e

#: how long a test waits for P to be idle before it sends a streamed handoff
IDLE_WITHIN_S = 30.0
#: when a test cuts a streamed HUGE handoff short at the latest, seconds after sending it
CUT_AFTER_S = 0.6
#: how many fresh HUGE prompts a test sends at most to catch P mid-prompt (see :func:`_sent_both`)
CUT_ATTEMPTS = 3

T = TypeVar("T")


async def _sent_both(session: aiohttp.ClientSession, p: Engine, d: Engine, max_tokens: int,
                     prepare: Callable[[str], Awaitable[T]]
                     ) -> tuple[T, asyncio.Task[dict[str, Any]], asyncio.Task[dict[str, Any]]]:
    """A streamed handoff of a fresh HUGE prompt, both requests sent at once (D's answer
    ``max_tokens`` long), caught while P runs the prompt, for the test to cut one short:
    (what ``prepare`` returned for that prompt, the decode task, the prefill task).

    ``prepare`` runs on each prompt before it is sent (a test's reference answer from D, its
    counters). P is then mid-prompt: its prefill is held to ``PREFILL_RATE`` tokens/s, so a HUGE
    prompt (5,000+ tokens) takes it over two seconds on any machine, its last layer leaving no
    sooner than 0.8 x that after P scheduled it (connectors/emulated_prefill.py). Returns once P's
    /metrics shows it running, or at the latest :data:`CUT_AFTER_S` after sending (a poll still
    unanswered then is left), well inside the prompt. A machine that stalls for seconds can still
    let P answer first: under CI, P's /metrics poll and the test's own event loop have both been
    seen to wait out a whole HUGE prefill, twice in a row. That attempt then ends as a whole
    handoff and a fresh prompt is sent (P caches prefixes: the same one again would be no prefill
    at all), up to :data:`CUT_ATTEMPTS` times; AssertionError if P answered every one first."""
    missed = []
    for _ in range(CUT_ATTEMPTS):
        prompt = huge()
        prepared = await prepare(prompt)
        p_params, d_params = stream_params(p)
        # P idle first: then any request /metrics shows running is this prompt
        await wait_for(lambda: metric(p.url, "vllm:num_requests_running") == 0, IDLE_WITHIN_S, "P to be idle")
        decode = asyncio.create_task(complete(session, d, prompt, max_tokens, d_params))
        prefill = asyncio.create_task(complete(session, p, prompt, 1, p_params))
        sent = time.monotonic()
        polls: list[tuple[float, float]] = []       # (sent after s, took s) of each poll that saw nothing running
        while (left := sent + CUT_AFTER_S - time.monotonic()) > 0:
            started = time.monotonic()
            try:   # bounded by the deadline: a starved P has taken 3 s to answer one poll (its prefill was over)
                running = await asyncio.wait_for(asyncio.to_thread(metric, p.url, "vllm:num_requests_running"),
                                                 left)
            except TimeoutError:
                polls.append((round(started - sent, 3), round(time.monotonic() - started, 3)))
                break
            if running > 0:
                break
            polls.append((round(started - sent, 3), round(time.monotonic() - started, 3)))
            await asyncio.sleep(0.02)
        if not prefill.done():
            return prepared, decode, prefill
        if prefill.exception() is not None:   # P's request failed: the test fails, this was no miss
            decode.cancel()
            prefill.result()
        missed.append(f"P answered {time.monotonic() - sent:.2f} s after it was sent; polls {polls}")
        await decode          # P streamed every layer: D answers the whole handoff before the next attempt
    raise AssertionError(f"P answered each of {CUT_ATTEMPTS} HUGE prompts before it could be cut short: {missed}")


def _reference_counters_completed(session: aiohttp.ClientSession, p: Engine, d: Engine
                                  ) -> Callable[[str], Awaitable[tuple[dict[str, Any], Counters, int]]]:
    """A ``prepare`` for :func:`_sent_both`: D's own answer to the prompt (8 tokens, the reference),
    D's transfer counters, and how many streams P had completed."""
    async def prepare(prompt: str) -> tuple[dict[str, Any], Counters, int]:
        return await complete(session, d, prompt, 8), Counters(d), len(log_lines(p, STREAM_COMPLETED))
    return prepare


@pytest.fixture(scope="module")
def pair(engine_lock: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, Engine]]:
    """P and D (tests/e2e/socket_pair.py); both process groups killed at the end.

    ``engine_lock`` (tests/e2e/conftest.py) holds the machine-wide engine lock:
    run this module with plain pytest, not under an outer ``flock``.
    """
    with start_pair(tmp_path_factory.mktemp("socket-e2e")) as engines:
        yield engines


# Pulled and streamed handoffs answer like one engine and move the KV.

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


@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["short", "long"])
async def test_a_streamed_handoff_answers_like_one_engine_and_moves_the_kv(pair: tuple[Engine, Engine],
                                                                          prompt: str) -> None:
    p, d = pair
    async with aiohttp.ClientSession() as session:
        reference = await complete(session, d, prompt, 16)
        counters = Counters(d)
        streams_before = len(log_lines(p, STREAM_COMPLETED))
        dec = await streamed(session, p, d, prompt, 16)
    n = reference["usage"]["prompt_tokens"]
    assert dec["choices"][0]["text"] == reference["choices"][0]["text"]
    assert dec["usage"] == reference["usage"] and dec["choices"][0]["finish_reason"] == "length"
    moved = counters.delta()
    assert moved["ext"] >= n - 1 and moved["local"] <= 1 and moved["failed"] == 0, moved
    assert moved["bytes"] >= (n - 1) * 1024, moved        # tiny model: 1 KiB of KV per token
    assert len(log_lines(p, STREAM_COMPLETED)) == streams_before + 1
    # The stream's end freed P's blocks: no lease waits for a release.
    await wait_for(lambda: metric(p.url, "vllm:kv_cache_usage_perc") == 0, LEASE_S - 2, "P to free the blocks")


async def test_a_prompt_prefilled_chunk_by_chunk_and_then_from_the_prefix_cache_streams_whole(
        pair: tuple[Engine, Engine]) -> None:
    """A fresh LONG (none of it in P's prefix cache: earlier tests sent LONG) takes several of P's
    256-token steps (the stream follows each); sent again, P serves every full block from its prefix
    cache, which no forward writes: they must arrive all the same."""
    p, d = pair
    prompt = fresh(LONG)
    async with aiohttp.ClientSession() as session:
        reference = await complete(session, d, prompt, 8)
        n = reference["usage"]["prompt_tokens"]
        assert n > 3 * CHUNK_TOKENS, n
        hits: dict[str, float] = {}
        for attempt in ("computed", "cached"):
            hits_before = metric(p.url, "vllm:prefix_cache_hits_total")
            counters = Counters(d)
            dec = await streamed(session, p, d, prompt, 8)
            moved = counters.delta()
            hits[attempt] = metric(p.url, "vllm:prefix_cache_hits_total") - hits_before
            assert dec["choices"][0]["text"] == reference["choices"][0]["text"], attempt
            assert moved["ext"] >= n - 1 and moved["failed"] == 0, (attempt, moved)
    assert hits["computed"] == 0, f"P's first prefill was served from its cache: {hits}"
    # every full block before the last prompt token (which vLLM always computes)
    block = block_size(p)
    assert hits["cached"] >= (n - 1) // block * block > 0, f"P's second prefill missed its cache: {hits}, {block=}"


# Leases nobody reads.

async def test_lease_expiry_frees_blocks(pair: tuple[Engine, Engine]) -> None:
    p, _ = pair
    expired_before = metric(p.url, "vllm:socket_kv_expired_reqs_total")
    async with aiohttp.ClientSession() as session:
        await complete(session, p, LONG, 1, dict(REMOTE_DECODE))
    assert metric(p.url, "vllm:kv_cache_usage_perc") > 0, "P should hold the blocks for the decode side"
    await wait_for(lambda: metric(p.url, "vllm:kv_cache_usage_perc") == 0, LEASE_S + 10, "the lease to expire")
    await wait_for(lambda: metric(p.url, "vllm:socket_kv_expired_reqs_total") == expired_before + 1, 10,
                   "the expiry to be counted")


async def test_a_lease_nobody_streams_expires(pair: tuple[Engine, Engine]) -> None:
    p, _ = pair
    expired_before = metric(p.url, "vllm:socket_kv_expired_reqs_total")
    async with aiohttp.ClientSession() as session:
        await complete(session, p, LONG, 1, stream_params(p)[0])
    assert metric(p.url, "vllm:kv_cache_usage_perc") > 0, "P should hold the blocks for the stream"
    await wait_for(lambda: metric(p.url, "vllm:kv_cache_usage_perc") == 0, LEASE_S + 10, "the lease to expire")
    await wait_for(lambda: metric(p.url, "vllm:socket_kv_expired_reqs_total") == expired_before + 1, 10,
                   "the expiry to be counted")


# Refused and declined input.

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
        fresh_params = (await complete(session, p, SHORT, 1, dict(REMOTE_DECODE)))["kv_transfer_params"]
        dec = await complete(session, d, SHORT, 8, fresh_params)
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


# Streams that never start, or are cut short by a client.

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
    async with aiohttp.ClientSession() as session:
        async def prepare(prompt: str) -> tuple[dict[str, Any], Counters]:
            reference = await complete(session, d, prompt, 8)
            assert reference["usage"]["prompt_tokens"] > 20 * CHUNK_TOKENS
            return reference, Counters(d)

        (reference, counters), decode, prefill = await _sent_both(session, p, d, 8, prepare)
        prefill.cancel()                         # the client left: aiohttp closes P's connection, vLLM aborts
        dec = await decode
    assert dec["choices"][0]["text"] == reference["choices"][0]["text"]
    assert counters.delta()["failed"] == 1
    await wait_for(lambda: metric(p.url, "vllm:kv_cache_usage_perc") == 0, 10, "P to free the blocks")
    # the stream ended with the abort (or, had P not scheduled it yet, was never opened)
    assert log_lines(p, "ended after") or log_lines(p, "no stream"), "P's listener never saw the stream end"


async def test_a_decode_request_aborted_mid_stream_frees_both_sides(pair: tuple[Engine, Engine]) -> None:
    p, d = pair
    async with aiohttp.ClientSession() as session:
        async def prepare(prompt: str) -> None:
            return None

        _, decode, prefill = await _sent_both(session, p, d, 64, prepare)
        decode.cancel()
        await prefill                            # P finishes its prefill; the cut stream frees it
    await wait_for(lambda: metric(d.url, "vllm:kv_cache_usage_perc") == 0, IO_TIMEOUT_S + 5, "D to free its blocks")
    # P frees at once when the cut stream had begun, else when its lease expires.
    await wait_for(lambda: metric(p.url, "vllm:kv_cache_usage_perc") == 0, LEASE_S + 10, "P to free its blocks")
    assert p.alive() and d.alive()


# P frozen (SIGSTOP, then SIGCONT): it serves again afterwards.

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


async def test_a_frozen_prefill_mid_stream_times_out_to_local_recompute(pair: tuple[Engine, Engine]) -> None:
    """P stops (SIGSTOP) while streaming: D gives up after its I/O timeout and recomputes; once P runs
    again it finds the stream's reader gone and frees the blocks."""
    p, d = pair
    async with aiohttp.ClientSession() as session:
        (reference, counters, completed_before), decode, prefill = await _sent_both(
            session, p, d, 8, _reference_counters_completed(session, p, d))
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


# Last: P killed.

async def test_prefill_killed_mid_stream_and_after_a_prefill_leads_to_local_recompute(
        pair: tuple[Engine, Engine]) -> None:
    """Runs last: P dies while streaming one prompt and with another's pulled lease outstanding
    (prefilled, not yet fetched); D recomputes both, no hang."""
    p, d = pair
    async with aiohttp.ClientSession() as session:
        pulled_reference = await complete(session, d, LONG, 8)
        pre = await complete(session, p, LONG, 1, dict(REMOTE_DECODE))   # fetched once P is dead

        (reference, counters, completed_before), decode, prefill = await _sent_both(
            session, p, d, 8, _reference_counters_completed(session, p, d))
        # SIGTERM kills P's engine at once; its HTTP server then waits for the open prefill request
        # (which the client leaves once D answered), else for Engine.stop's 15 s before SIGKILL
        stopping = asyncio.create_task(asyncio.to_thread(p.stop))
        started = time.monotonic()
        dec = await decode
        elapsed = time.monotonic() - started
        prefill.cancel()
        await stopping
        assert not p.alive()
        # the premise: P had not sent the whole stream when it died (else D had every layer and nothing failed)
        assert len(log_lines(p, STREAM_COMPLETED)) == completed_before, "P completed the stream before it died"
        assert dec["choices"][0]["text"] == reference["choices"][0]["text"]
        # the failure reaches /metrics with the engine core's stats, which may trail the reply
        try:
            await wait_for(lambda: counters.delta()["failed"] == 1, 10, "D to count the failed stream")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; D's counters moved by {counters.delta()}") from None
        assert elapsed < 30, elapsed
        # The pulled lease of the dead P: D's fetch fails and D recomputes the prompt.
        started = time.monotonic()
        dec = await complete(session, d, LONG, 8, pre["kv_transfer_params"])
        elapsed = time.monotonic() - started
    assert dec["choices"][0]["text"] == pulled_reference["choices"][0]["text"]
    assert elapsed < 60, elapsed
    try:
        await wait_for(lambda: counters.delta()["failed"] == 2, 10, "D to count the failed fetch")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; D's counters moved by {counters.delta()}") from None
    assert d.alive()
