"""The socket connector with ``connector: {type: socket, wire_format: fp8}`` on real engines: a
1P1D on loopback behind the proxy (every prompt split), the KV crossing as float8 with a scale per
128 elements.

Both transfer modes, on the one deployment: pulled (the proxy's handoff: P prefills, then D fetches
the blocks P leased) and streamed (each layer's KV sent while P prefills). The deployment's proxy
pulls (``streaming: false``); the streamed tests do what the proxy's ``vllm-socket-stream`` handoff
does, by hand: they send P and D their requests at once, joined by a ``stream_key``, straight to the
engines (with the engine key), whose connectors stream whatever the topology says.

What holds: each prompt's KV moves (the decode engine computes at most the last prompt token
itself), at the fp8 size (the tiny model keeps 1 KiB of bf16 KV per token: 528 bytes on the wire),
and every reply has the colocated server's shape: finish reason, usage, token count. A streamed
transfer is one (both engines log it as streamed, none as fetched or served), P sends the bytes D
counts, and P's blocks are free once the stream ended (no release, no lease expiry). What fp8
costs the greedy text is printed, not asserted: on a random-weight model it says nothing about a
real one (benchmarks/gpu/verify.sh measures that).

Sorts after test_socket_conformance (whose last test stops its deployment) and starts only once
no other engine on the session's model runs.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from disagg.prometheus_text import sample_sum
from disagg.prompts import exact_prompt
from disagg.proxy.handoff import VllmHandoff
from disagg.proxy.routes import COMPLETIONS
from disagg.proxy.socket_stream_handoff import KvPeer, SocketStreamHandoff, new_stream_key
from disagg.topology import load_topology
from harness.engines import ENGINE_KEY, SPLIT_EVERY_PROMPT, Running, bring_up_socket_pd, get_text, post_json

pytestmark = pytest.mark.e2e

#: bf16 KV bytes per token of the tiny model (2 layers x 2 KV heads x 64 x K and V x 2 bytes), vLLM's
#: CPU block size, and what fp8 puts on the wire for one block: a byte per element and a float32 scale
#: per 128 elements
KV_BYTES_PER_TOKEN = 1024
BLOCK_TOKENS = 128
FP8_BLOCK_BYTES = BLOCK_TOKENS * KV_BYTES_PER_TOKEN // 2 * (1 + 4 / 128)
#: the streamed tests' prompts, by name: their length in tokens (each with a tag of its own, so that
#: neither engine's prefix cache holds it when it is streamed)
STREAMED = {"short": 50, "long": 1500}
#: what each engine logs per transfer, by mode: D "streamed"/"fetched", P "streamed"/"served"
LOGGED = "socket KV connector: "


@pytest.fixture(scope="module")
def fp8_pd(reference: dict[str, str], e2e_dir: Path, tiny_model: Path) -> Iterator[Running]:
    run = bring_up_socket_pd(e2e_dir, tiny_model, "pd-socket-fp8", extra=SPLIT_EVERY_PROMPT, wire_format="fp8")
    try:
        yield run
    finally:
        done = run.down()
        assert done.returncode == 0, done.stderr


def _completion(proxy: str, body: dict) -> tuple[str, dict]:
    req = urllib.request.Request(proxy + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return resp.headers["X-Disagg-Route"], json.loads(resp.read())


@pytest.mark.parametrize("name", ["short", "long"])
def test_fp8_moves_each_prompt_at_half_the_bytes(fp8_pd: Running, requests_: dict[str, dict],
                                                 reference: dict[str, str], name: str) -> None:
    decode = fp8_pd.engines["decode[0]"]
    body = {**requests_[name], "logprobs": 1}
    before = get_text(decode + "/metrics")
    route, reply = _completion(fp8_pd.proxy_url, body)
    after = get_text(decode + "/metrics")

    def delta(metric: str, **labels: str) -> float:
        return sample_sum(after, metric, **labels) - sample_sum(before, metric, **labels)

    n = reply["usage"]["prompt_tokens"]
    assert route == "split"
    assert delta("vllm:prompt_tokens_by_source_total", source="external_kv_transfer") >= n - 1
    assert delta("vllm:prompt_tokens_by_source_total", source="local_compute") <= 1
    moved = delta("vllm:socket_kv_bytes_received_total")
    # whole blocks, those of the prompt (vLLM may leave the last token's block to recompute)
    blocks = moved / FP8_BLOCK_BYTES
    assert blocks in (-(-(n - 1) // BLOCK_TOKENS), -(-n // BLOCK_TOKENS)), (moved, n)
    assert moved / (blocks * BLOCK_TOKENS * KV_BYTES_PER_TOKEN) == pytest.approx(0.515625)  # of bf16's bytes
    # the reply has a colocated server's shape; the text is fp8's to change (printed)
    choice = reply["choices"][0]
    # the prefill engine's own answer: computed from its own (exact) KV. Not the decode engine's: its
    # prefix cache now holds the prompt's blocks as fp8 brought them
    plain = post_json(fp8_pd.engines["prefill[0]"] + "/v1/completions", body, key=ENGINE_KEY)
    mine = plain["choices"][0]
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [reply["usage"][k] for k in counts] == [plain["usage"][k] for k in counts]
    assert choice["finish_reason"] == mine["finish_reason"]
    assert mine["text"] == reference[name]          # one engine alone is the colocated server
    # the first token comes from the transferred KV alone: the same token, its log-prob close (measured
    # here: within 0.06 nats over 20 prompts of 20-700 tokens)
    assert choice["logprobs"]["tokens"][0] == mine["logprobs"]["tokens"][0]
    drift = abs(choice["logprobs"]["token_logprobs"][0] - mine["logprobs"]["token_logprobs"][0])
    assert drift < 0.2, drift
    tokens, theirs = choice["logprobs"]["tokens"], mine["logprobs"]["tokens"]
    common = next((i for i, (a, b) in enumerate(zip(tokens, theirs, strict=True)) if a != b), len(tokens))
    print(f"fp8 wire, {name} ({n} prompt tokens, {moved / 1e3:.1f} kB moved): first-token log-prob drift "
          f"{drift:.4f}; greedy text {'equals' if choice['text'] == mine['text'] else 'differs from'} the "
          f"colocated server's ({common} of {len(tokens)} tokens in common)")


def _kv_peer(run: Running) -> KvPeer:
    """The prefill instance's KV listener, as the proxy's streaming handoff names it to D."""
    topo = load_topology(run.topology)
    inst = topo.role("prefill")[0]
    assert inst.kv_port is not None
    return KvPeer(topo.host_of(inst).address, inst.kv_port)


def _logged(run: Running, engine: str) -> dict[str, int]:
    """How many transfers ``engine`` logged so far, by verb (streamed, fetched, served)."""
    log = Path(next(r.log for r in run.state().processes if r.name == engine)).read_text(errors="replace")
    return {verb: log.count(LOGGED + verb + " ") for verb in ("streamed", "fetched", "served")}


def _wait(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.5)


@pytest.mark.parametrize("name", ["short", "long"])
def test_fp8_streams_each_prompt_while_it_is_prefilled_at_half_the_bytes(fp8_pd: Running, tokenizer: Tokenizer,
                                                                         name: str) -> None:
    """P and D get their requests at once, as the proxy's ``vllm-socket-stream`` handoff sends them
    (its own request bodies and ``kv_transfer_params``), straight to the engines."""
    prefill, decode = fp8_pd.engines["prefill[0]"], fp8_pd.engines["decode[0]"]
    body = {"model": "tiny", "prompt": exact_prompt(tokenizer, STREAMED[name], f"fp8-stream-{name}"),
            "max_tokens": 24, "temperature": 0, "logprobs": 1}
    key = new_stream_key()
    p_body = VllmHandoff.prefill_body(COMPLETIONS, body, SocketStreamHandoff.prefill_params(key))
    d_body = VllmHandoff.decode_body(body, SocketStreamHandoff.decode_params(key, _kv_peer(fp8_pd)))
    logged = {eng: _logged(fp8_pd, eng) for eng in ("prefill[0]", "decode[0]")}
    before = {url: get_text(url + "/metrics") for url in (prefill, decode)}
    with ThreadPoolExecutor(2) as pool:
        p_reply = pool.submit(post_json, prefill + "/v1/completions", p_body, key=ENGINE_KEY)
        d_reply = pool.submit(post_json, decode + "/v1/completions", d_body, key=ENGINE_KEY)
        reply = d_reply.result()
        assert p_reply.result()["usage"]["completion_tokens"] == 1
    after = get_text(decode + "/metrics")

    def delta(url: str, metric: str, now: str | None = None, **labels: str) -> float:
        return sample_sum(now if now is not None else get_text(url + "/metrics"), metric, **labels) \
            - sample_sum(before[url], metric, **labels)

    n = reply["usage"]["prompt_tokens"]
    assert n == STREAMED[name]
    assert delta(decode, "vllm:prompt_tokens_by_source_total", after, source="external_kv_transfer") >= n - 1
    assert delta(decode, "vllm:prompt_tokens_by_source_total", after, source="local_compute") <= 1
    assert delta(decode, "vllm:socket_kv_transfers_total", after) == 1
    assert delta(decode, "vllm:socket_kv_failed_transfers_total", after) == 0
    moved = delta(decode, "vllm:socket_kv_bytes_received_total", after)
    # whole blocks, those of the prompt (a stream sends the last, partial one once the prompt is written)
    blocks = moved / FP8_BLOCK_BYTES
    assert blocks in (-(-(n - 1) // BLOCK_TOKENS), -(-n // BLOCK_TOKENS)), (moved, n)
    assert moved / (blocks * BLOCK_TOKENS * KV_BYTES_PER_TOKEN) == pytest.approx(0.515625)  # of bf16's bytes
    # the reply has a colocated server's shape; the text is fp8's to change (printed). The prefill
    # engine's own answer is the colocated server's (one engine alone; the fetched tests check that
    # against the reference server): computed from its own (exact) KV, which its prefix cache keeps
    plain = post_json(prefill + "/v1/completions", body, key=ENGINE_KEY)
    choice, mine = reply["choices"][0], plain["choices"][0]
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [reply["usage"][k] for k in counts] == [plain["usage"][k] for k in counts]
    assert choice["finish_reason"] == mine["finish_reason"]
    assert choice["logprobs"]["tokens"][0] == mine["logprobs"]["tokens"][0]
    drift = abs(choice["logprobs"]["token_logprobs"][0] - mine["logprobs"]["token_logprobs"][0])
    assert drift < 0.2, drift
    # the streamed path, not a fetch: both engines logged a stream and no fetch; P sent what D counted
    # (at the fp8 size too) and freed the blocks as the stream ended, with no release from D and long
    # before the lease (30 s) would have expired (P's counters reach /metrics with its next steps: the
    # plain request's)
    _wait(lambda: delta(prefill, "vllm:socket_kv_bytes_served_total") == moved
          and sample_sum(get_text(prefill + "/metrics"), "vllm:kv_cache_usage_perc") == 0, 10,
          f"P to count {moved:.0f} bytes served and free its blocks")
    _wait(lambda: _logged(fp8_pd, "prefill[0]")["streamed"] == logged["prefill[0]"]["streamed"] + 1, 10,
          "P to log the stream")
    assert _logged(fp8_pd, "prefill[0]") == {**logged["prefill[0]"], "streamed": logged["prefill[0]"]["streamed"] + 1}
    assert _logged(fp8_pd, "decode[0]") == {**logged["decode[0]"], "streamed": logged["decode[0]"]["streamed"] + 1}
    tokens, theirs = choice["logprobs"]["tokens"], mine["logprobs"]["tokens"]
    common = next((i for i, (a, b) in enumerate(zip(tokens, theirs, strict=True)) if a != b), len(tokens))
    print(f"fp8 wire, streamed, {name} ({n} prompt tokens, {moved / 1e3:.1f} kB moved): first-token log-prob "
          f"drift {drift:.4f}; greedy text {'equals' if choice['text'] == mine['text'] else 'differs from'} the "
          f"colocated server's ({common} of {len(tokens)} tokens in common)")
