"""The socket connector with ``connector: {type: socket, wire_format: fp8}`` on real engines: a
1P1D on loopback behind the proxy (every prompt split), the KV crossing as float8 with a scale per
128 elements.

What holds: each prompt's KV moves (the decode engine computes at most the last prompt token
itself), at the fp8 size (the tiny model keeps 1 KiB of bf16 KV per token: 528 bytes on the wire),
and every reply has the colocated server's shape: finish reason, usage, token count. What fp8
costs the greedy text is printed, not asserted: on a random-weight model it says nothing about a
real one (benchmarks/gpu/verify.sh measures that).

Sorts after test_socket_conformance (whose last test stops its deployment) and starts only once
no other engine on the session's model runs.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from disagg.prometheus_text import sample_sum
from tests.e2e.engines import ENGINE_KEY, SPLIT_EVERY_PROMPT, Running, bring_up_socket_pd, get_text, post_json

pytestmark = pytest.mark.e2e

#: bf16 KV bytes per token of the tiny model (2 layers x 2 KV heads x 64 x K and V x 2 bytes), vLLM's
#: CPU block size, and what fp8 puts on the wire for one block: a byte per element and a float32 scale
#: per 128 elements
KV_BYTES_PER_TOKEN = 1024
BLOCK_TOKENS = 128
FP8_BLOCK_BYTES = BLOCK_TOKENS * KV_BYTES_PER_TOKEN // 2 * (1 + 4 / 128)


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

