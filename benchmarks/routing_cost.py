"""What the routing costs the proxy per prompt: the policy's decision and the prompt-length estimate.

Times, in this process (no engines, no network):

- the decision: ``Router.route`` on a one-prompt plan, as the proxy calls it per request
  (candidates from the live measurements, every option of every prefill x decode pair,
  the metric and the route written), with ``--pairs`` prefill and decode engines, once
  every engine's lines have samples, its KV cache holds routes and requests decode on it
  (``_steady_state``);
- the prompt-length estimate of a ``--tokens``-token prompt: with the embedded model's
  ``tokenizer.json`` (the ``tokenizers`` library) and from characters.

With an SLO (``--slo``) what the decision computes depends on the prompt's own chance, and it
prints the paths and reasons it decided: with ``--slo 1.0,0.025`` the steady state's prompt meets
neither objective on any path (the score decides, and the running decodes are not judged);
with ``--slo 30,1`` every option meets both objectives and every stream decoding (``--decoding``
per engine, none past its objective) is judged for every option that loads its engine, but those
that even the decision's largest stall leaves safe (with 8 per engine, 6 on each).

Targets of the ``auto`` routing: decision p50 <= 0.1 ms; length estimate p50 <= 1 ms for 2,000 tokens.

    .venv/bin/python benchmarks/routing_cost.py [--repeats 5000] [--tokens 2000] [--pairs 1] [--decoding 8]
        [--slo TTFT,TPOT]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from disagg.modelgen import build_model
from disagg.prompts import exact_prompt, load_tokenizer
from disagg.proxy.backends import Backend, BackendPool
from disagg.proxy.config import RoutingConfig
from disagg.proxy.metrics import ProxyMetrics
from disagg.proxy.promptlen import SAMPLE_CHARS, PromptLength
from disagg.proxy.router import Router
from disagg.proxy.routes import COMPLETIONS, GenerationRequest, PromptRoute, RequestPlan, RoutePath


def _percentiles(samples: list[float]) -> str:
    q = statistics.quantiles(samples, n=100)
    return f"p50 {statistics.median(samples) * 1e3:.4f} ms, p90 {q[89] * 1e3:.4f} ms, p99 {q[98] * 1e3:.4f} ms"


#: KV cache each engine declares, and the routes booked on each (what a loaded engine holds)
KV_CAPACITY_TOKENS, KV_BOOKED = 6144.0, 8
#: requests decoding on each engine by default, each a stream the router follows (with a TPOT objective)
DECODING = 8


@dataclass
class _Progress:
    """A stream's token events, as the relay counts them."""

    token_events: int


def _decoding(router: Router, backend: Backend, now: float, decoding: int) -> None:
    """``decoding`` requests decoding on ``backend``, streamed, at different points of 64 tokens,
    through the route's lifecycle as the app reports it (followed with a TPOT objective)."""
    for i in range(decoding):
        body = {"prompt": "x", "stream": True, "max_tokens": 64}
        req = GenerationRequest(COMPLETIONS, body, b"{}", {}, f"decoding-{i}")
        whole = backend.role == "prefill"
        route = PromptRoute(0, req, RoutePath.WHOLE if whole else RoutePath.LOCAL, reason="bench",
                            prefill=backend if whole else None, decode=None if whole else backend,
                            tokens=64, expected_out=64.0)
        router.route(RequestPlan(req, [route]))
        route.sent(stream=True, now=now - 5.0)
        tokens = 1 + i * 56 // decoding
        route.watch(_Progress(tokens))
        route.first_token(now - 0.04 * tokens)
    backend.outstanding += decoding


def _steady_state(router: Router, pools: Sequence[BackendPool], decoding: int = DECODING) -> None:
    """Every line a serving proxy has learned, with samples at several loads: each engine's prefill
    line and busy line, and its time per output token, so the decision asks all of them as it does
    while serving (the decode lines are what the ``decode_load`` rule compares); and each engine's
    KV cache size with routes booked in it, so the wait for room is priced as under load; and
    ``decoding`` streamed requests decoding on each engine (:func:`_decoding`)."""
    m = router.measurements
    now = time.perf_counter()
    backends = [b for pool in pools for b in pool.backends]
    for b in backends:
        _decoding(router, b, now, decoding)
    for pool in pools:
        for b in pool.backends:
            pool.set_kv_capacity(b, KV_CAPACITY_TOKENS)
            for i in range(KV_BOOKED):
                router.kv.hold(b.url, 2304.0, now + 1.0 + i)
    for b in backends:
        for i in range(12):
            load = 1 + i % 6
            m.observe_prefill(b.role, b.url, 64.0 + 64 * (i % 5), 0.01 + (64 + 64 * (i % 5)) / 2000)
            m.observe_prefill(b.role, b.url, 64.0, 0.05 + 0.01 * load, in_flight=load)
            m.observe_decode(b.url, load, 0.03 + 0.005 * load)


def _slo(text: str | None) -> dict[str, float]:
    """``--slo TTFT,TPOT`` as RoutingConfig's fields."""
    if text is None:
        return {}
    ttft, tpot = (float(v) for v in text.split(","))
    return {"slo_ttft_s": ttft, "slo_tpot_s": tpot}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5000)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--pairs", type=int, default=1, help="prefill and decode engines each")
    parser.add_argument("--decoding", type=int, default=DECODING,
                        help=f"streamed requests decoding on each engine (default {DECODING})")
    parser.add_argument("--slo", default=None, metavar="TTFT,TPOT",
                        help="decide with an SLO (seconds), e.g. 1.0,0.025: routing for goodput")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="disagg-routing-") as scratch:
        return measure(args, Path(scratch))


def measure(args: argparse.Namespace, scratch: Path) -> int:
    """Builds the tiny model under ``scratch`` (removed by the caller), times and prints."""
    model = build_model("tiny", scratch / "tiny")
    tok = load_tokenizer(model)
    prompt = exact_prompt(tok, args.tokens, "bench")
    metrics = ProxyMetrics()
    pools = [BackendPool(role, [f"http://{role}{i}:1" for i in range(args.pairs)], metrics)
             for role in ("prefill", "decode")]
    for pool in pools:
        for b in pool.backends:
            pool.mark_up(b)
    config = RoutingConfig(policy="auto", kv_bytes_per_token=32768.0, prefill_tokens_per_s=2000.0,
                           link_bytes_per_s=1.25e8, handoff_fixed_s=0.016, whole=True,
                           tokenizer=str(model / "tokenizer.json"), **_slo(args.slo))
    router = Router(config, pools[0], pools[1], metrics, local=True)
    _steady_state(router, pools, args.decoding)
    ids = tok.encode(prompt).ids
    # the decision alone: a prompt of token ids has an exact length that costs nothing to read
    by_ids = GenerationRequest(COMPLETIONS, {"prompt": ids, "max_tokens": 16}, b"{}", {}, "bench")
    body = {"prompt": prompt, "max_tokens": 16}
    by_chars = PromptLength(None)
    assert router.lengths is not None
    decide, estimate_tok, estimate_chars = [], [], []
    reasons: Counter[str] = Counter()
    for _ in range(args.repeats):
        route = PromptRoute(0, by_ids, RoutePath.SPLIT)
        plan = RequestPlan(by_ids, [route])
        t0 = time.perf_counter()
        router.route(plan)
        t1 = time.perf_counter()
        reasons[f"{route.path.value} {route.reason}"] += 1
        router.lengths.tokens(body, chat=False)
        t2 = time.perf_counter()
        by_chars.tokens(body, chat=False)
        t3 = time.perf_counter()
        decide.append(t1 - t0)
        estimate_tok.append(t2 - t1)
        estimate_chars.append(t3 - t2)
    errors = []
    for i, n in enumerate(range(100, 4001, 100)):
        p = exact_prompt(tok, n, f"err{i}")
        errors.append(abs(router.lengths.tokens({"prompt": p}, chat=False) - len(tok.encode(p).ids))
                      / len(tok.encode(p).ids))
    print(f"routing cost, {args.repeats} repeats, {args.pairs} prefill x {args.pairs} decode engines"
          + (f", SLO {args.slo} s" if args.slo else "") + ", "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"  decision (Router.route, a token-id prompt): {_percentiles(decide)}; decided "
          + ", ".join(f"{key} {n / args.repeats:.0%}" for key, n in reasons.most_common()))
    print(f"  length estimate, tokenizer, {len(ids)}-token prompt ({len(prompt)} chars): {_percentiles(estimate_tok)}")
    print(f"  length estimate error with the tokenizer, prompts of 100..4,000 tokens: mean "
          f"{statistics.mean(errors):.1%}, max {max(errors):.1%} (exact up to {SAMPLE_CHARS} characters)")
    chars_est = by_chars.tokens(body, chat=False)
    print(f"  length estimate, characters / 4: {_percentiles(estimate_chars)} "
          f"(uncalibrated: {chars_est} for {len(ids)}, error {abs(chars_est - len(ids)) / len(ids):.0%}; "
          "the proxy corrects it from the engines' counts)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
