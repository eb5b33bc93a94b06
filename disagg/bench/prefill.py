"""The measured prefill rate of a host, stored for ``disagg plan``.

Two ways to measure it:

- from a run: prompt tokens / TTFT over requests that ran alone (no other
  request in flight between their send and their first token), taking the
  longest prompts so fixed overheads weigh least;
- a probe: a few long prompts at concurrency 1 with ``max_tokens: 1``, sent
  straight to an engine (for a disaggregated topology, the prefill engine, so
  the KV handoff is not counted).

Stored in ``<run_dir>/measurements/prefill.json``::

    {"<served model>": {"<host>": {"prompt_tokens_per_s": 1234.5,
                                   "measured_at": "2026-01-01T00:00:00+00:00",
                                   "source": "..."}}}

The format and its writer belong to :mod:`disagg.measurements` (it merges, so
measurements of other models and hosts are kept); this module only measures.

An engine's decode step (:func:`probe_decode_step`): prompts of two lengths (short and long), a few
of each, sent one at a time straight to the engine, each answered with
:data:`DECODE_PROBE_OUTPUT` tokens (``ignore_eos``), streamed; each request's TPOT is
``(e2e - ttft) / (tokens - 1)`` at a mean context of ``prompt + tokens / 2``, and the line through
those points (:func:`fit_decode`: TPOT against the context's KV bytes) is the engine's idle decode
step, ``fixed + per byte x context KV``, stored by :func:`disagg.measurements.store_decode`.
Called, with the prefill probe, by :func:`probe_engine` (``disagg bench prefill`` and
``disagg bench compare``).

A pair's handoff (:func:`probe_handoff_fixed`): the fixed cost of a handoff on one prefill ->
decode pair, measured the way ``benchmarks/handoff_fixed_cost.py`` measured the figures that seed
every pair (:data:`disagg.routecost.HANDOFF_FIXED_S`): prompts of one length sent one at a time,
in turn straight to the prefill engine (a plain request: the prefill alone) and through the proxy
(a split: the same prefill, then the handoff), each with a prompt of its own so no prefix cache
helps; the median of ``TTFT(split) - TTFT(on P)`` over the pairs, less the part of the handoff
that grows with the prompt's KV (the transfer and decode's first step reading that KV, as
``disagg plan`` prices them), is the pair's fixed cost; probed at two lengths
(:func:`disagg.bench.compare.probe_handoff`), the line through the two medians is the fixed cost
and what each byte adds, as measured. It counts only when the proxy split every
prompt sent through it by its policy: its ``disagg_route_total{path="split",reason="policy"}`` must
grow by as many (:data:`SPLIT_BY_POLICY`: a topology routed ``auto`` chooses per prompt; ``disagg
bench compare --routing split`` splits them all). Called by :func:`disagg.bench.compare.compare`; stored by
:func:`disagg.measurements.store_handoff`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from disagg.bench.client import COMPLETIONS_PATH, send_request
from disagg.bench.prompts import build_prompts
from disagg.bench.records import RequestRecord
from disagg.bench.routes import scrape
from disagg.bench.workload import PromptClass, Workload
from disagg.errors import DisaggError
from disagg.measurements import engine_words, fit_decode_step, store_decode, store_prefill


def isolated(records: Sequence[RequestRecord]) -> list[RequestRecord]:
    """Successful records with no other request in flight between their send and first token."""
    out = []
    for rec in records:
        first = rec.first_token
        if not rec.success or first is None:
            continue
        overlaps = any(o is not rec and o.send < first and (o.end if o.end is not None else o.send) > rec.send
                       for o in records)
        if not overlaps:
            out.append(rec)
    return out


def prefill_rate_from_records(records: Sequence[RequestRecord]) -> tuple[float, int] | None:
    """(prompt tokens per second, requests used) over isolated requests whose prompt is at
    least half the longest isolated prompt; None when no request ran alone."""
    return prefill_rate_from_runs([records])


def prefill_rate_from_runs(runs: Sequence[Sequence[RequestRecord]]) -> tuple[float, int] | None:
    """:func:`prefill_rate_from_records` over several runs (isolation is judged within each run)."""
    alone = [r for records in runs for r in isolated(records)]
    if not alone:
        return None
    longest = max(r.prompt_tokens for r in alone)
    used = [r for r in alone if r.prompt_tokens * 2 >= longest]
    seconds = sum(r.ttft or 0.0 for r in used)
    if seconds <= 0:
        return None
    return sum(r.prompt_tokens for r in used) / seconds, len(used)


async def probe_prefill_rate(base_url: str, model: str, prompt_tokens: int, count: int = 3,
                             seed: int = 0, timeout_s: float = 600.0,
                             headers: Mapping[str, str] | None = None) -> float:
    """Prompt tokens/s over ``count`` prompts of ``prompt_tokens`` sent one at a time with
    ``max_tokens`` 1 to ``base_url`` (the first prompt, a warm-up, is not counted).

    ``headers`` go with every request (an engine started by ``disagg up`` wants
    ``Authorization: Bearer <engine key>``)."""
    workload = Workload((PromptClass("probe", prompt_tokens, 1),), num_requests=count + 1, seed=seed,
                        timeout_s=timeout_s)
    base = base_url.rstrip("/")
    async with aiohttp.ClientSession(headers=dict(headers or {})) as session:
        prompts = await build_prompts(session, [base], model, workload, ["probe"] * (count + 1), round_index=9999)
        records = []
        for p in prompts:
            rec = await send_request(session, base + COMPLETIONS_PATH, p, model, workload, time.perf_counter())
            if not rec.success:
                raise DisaggError(f"prefill probe to {base} failed: {rec.error}")
            records.append(rec)
    used = records[1:]
    return sum(r.prompt_tokens for r in used) / sum(r.ttft or 0.0 for r in used)


#: the prompt length of the probe: short, so that the part of the handoff that grows with the KV
#: (subtracted as the plan prices it) weighs little beside the fixed cost
HANDOFF_PROBE_TOKENS = 128
#: the probe's second length (the workload's longest prompt) counts only at this many times the first
#: or more: the line through the two is then the pair's fixed cost and what each byte of KV adds
HANDOFF_PROBE_LONG_FACTOR = 4
#: the fewest pairs the handoff probe measures, whatever the engines' probe count: its median
#: then stands against one or two slow pairs (3 pairs on the emulated house gave 14.5, 24 and
#: 95.6 ms in three runs of one configuration; the splits themselves took about 20-45 ms more than
#: the prefill alone)
HANDOFF_PROBE_MIN_PAIRS = 7


#: the routes (path, reason) the handoff probe counts: splits by the proxy's policy (``routing:
#: split``). An ``auto`` proxy that splits every probe prompt does not count: its splits are its
#: choices under the load it sees (one measured 150 ms at 128 tokens on the emulated house where
#: the static split's took 21 ms), not a controlled measurement of the pair
SPLIT_BY_POLICY = ("split", "policy")


async def probe_handoff_fixed(proxy_url: str, prefill_url: str, model: str, count: int, per_byte_s: float,
                              prompt_tokens: int = HANDOFF_PROBE_TOKENS, seed: int = 0,
                              engine_headers: Mapping[str, str] | None = None,
                              timeout_s: float = 600.0) -> tuple[float, float] | None:
    """(fixed cost, median TTFT(split) - TTFT(on P)) in seconds over ``count`` pairs of prompts of
    ``prompt_tokens`` (after one warm-up pair, not counted), or None when the proxy did not split
    every prompt sent through it by its policy (:data:`SPLIT_BY_POLICY`) or has no routing metrics.
    ``per_byte_s``: what the plan prices for the handoff's KV-sized part at ``prompt_tokens``
    (subtracted; the fixed cost is never below 0). ``engine_headers`` go to the prefill engine only (the engine key)."""
    if count < 1:
        raise ValueError("count must be at least 1")
    pairs = count + 1
    workload = Workload((PromptClass("handoff", prompt_tokens, 1),), num_requests=2 * pairs, seed=seed,
                        timeout_s=timeout_s)
    proxy, engine = proxy_url.rstrip("/"), prefill_url.rstrip("/")
    async with aiohttp.ClientSession() as session:
        before = await scrape(session, proxy)
        prompts = await build_prompts(session, [proxy], model, workload, ["handoff"] * (2 * pairs), round_index=9998)
        gaps = []
        for i in range(pairs):
            on_p = await send_request(session, engine + COMPLETIONS_PATH, prompts[2 * i], model, workload,
                                      time.perf_counter(), headers=dict(engine_headers or {}))
            split = await send_request(session, proxy + COMPLETIONS_PATH, prompts[2 * i + 1], model, workload,
                                       time.perf_counter())
            for rec, where in ((on_p, engine), (split, proxy)):
                if not rec.success or rec.ttft is None:
                    raise DisaggError(f"handoff probe to {where} failed: {rec.error}")
            if i:
                gaps.append((split.ttft or 0.0) - (on_p.ttft or 0.0))
        after = await scrape(session, proxy)
    if after is None:           # no routing metrics: not the disagg proxy, or it routed nothing
        return None
    splits = sum(v for route, v in after.routes.items() if route == SPLIT_BY_POLICY)
    if before is not None:      # (a proxy that has routed nothing yet shows no routing series)
        splits -= sum(v for route, v in before.routes.items() if route == SPLIT_BY_POLICY)
    if splits < pairs:
        return None
    gap = statistics.median(gaps)
    return max(0.0, gap - per_byte_s), gap


#: the prefill probe's second length: the long one over this, when at least PREFILL_SHORT_MIN tokens
PREFILL_SHORT_DIVISOR = 8
PREFILL_SHORT_MIN = 32

#: the decode probe's answer length (tokens, ``ignore_eos``) and its short prompt
DECODE_PROBE_OUTPUT = 64
DECODE_PROBE_SHORT = 64


@dataclass(frozen=True)
class DecodePoint:
    """One request of the decode probe: its prompt, its answer's tokens and its time per output token."""

    prompt_tokens: int
    output_tokens: int
    tpot_s: float

    @property
    def context_tokens(self) -> float:
        """The mean context of its decode steps: the step making token k (k = 2..n) reads
        ``prompt + k - 1`` tokens of KV, ``prompt + n / 2`` on average."""
        return self.prompt_tokens + self.output_tokens / 2


async def probe_decode_step(base_url: str, model: str, long_tokens: int, count: int = 2,
                            short_tokens: int = DECODE_PROBE_SHORT, output_tokens: int = DECODE_PROBE_OUTPUT,
                            seed: int = 0, timeout_s: float = 600.0,
                            headers: Mapping[str, str] | None = None) -> list[DecodePoint]:
    """``count`` prompts of ``short_tokens`` and ``count`` of ``long_tokens``, in turn, one at a time
    to ``base_url``, each answered with ``output_tokens`` tokens (``ignore_eos``, streamed): one
    :class:`DecodePoint` per request. ``headers`` go with every request (the engine key)."""
    if count < 1 or output_tokens < 2 or long_tokens <= short_tokens:
        raise ValueError("the decode probe needs count >= 1, output_tokens >= 2 and long_tokens > short_tokens")
    workload = Workload((PromptClass("short", short_tokens, output_tokens),
                         PromptClass("long", long_tokens, output_tokens)),
                        num_requests=2 * count, seed=seed, timeout_s=timeout_s, ignore_eos=True)
    base = base_url.rstrip("/")
    points = []
    async with aiohttp.ClientSession(headers=dict(headers or {})) as session:
        prompts = await build_prompts(session, [base], model, workload, ["short", "long"] * count,
                                      round_index=9997)
        for p in prompts:
            rec = await send_request(session, base + COMPLETIONS_PATH, p, model, workload, time.perf_counter())
            if not rec.success or rec.ttft is None or rec.e2el is None:
                raise DisaggError(f"decode probe to {base} failed: {rec.error}")
            if rec.output_tokens < 2:
                raise DisaggError(f"decode probe to {base}: the answer had {rec.output_tokens} token(s), "
                                  f"not {output_tokens} (does the server honour ignore_eos?)")
            points.append(DecodePoint(rec.prompt_tokens, rec.output_tokens,
                                      (rec.e2el - rec.ttft) / (rec.output_tokens - 1)))
    return points


def fit_decode(points: Sequence[DecodePoint],
               kv_bytes: Callable[[int], float]) -> tuple[float, float, list[tuple[float, float]]]:
    """(fixed seconds, seconds per byte of context KV, the (KV bytes, TPOT) points) of the line
    through the probe's requests (:func:`disagg.measurements.fit_decode_step`); ``kv_bytes(n)``:
    the KV cache of an ``n``-token context in the engine's KV dtype."""
    xy = [(float(kv_bytes(round(p.context_tokens))), p.tpot_s) for p in points]
    fixed, per_byte = fit_decode_step(xy)
    return fixed, per_byte, xy


async def probe_engine(run_dir: str, model: str, dtype: str, host: str, engine: str, url: str, connector: str,
                       prefill_tokens: int, count: int, kv_bytes: Callable[[int], float], where: str,
                       seed: int = 0, headers: Mapping[str, str] | None = None,
                       max_model_len: int | None = None) -> dict[str, Any]:
    """Measure one engine (``engine`` of ``host`` at ``url``, running ``connector``:
    :data:`disagg.measurements.NO_CONNECTOR` for a colocated one) straight, with the engine key in
    ``headers``: its prefill rate (:func:`probe_prefill_rate`, ``count`` prompts of
    ``prefill_tokens``, and ``count`` of an eighth of it, so that plan knows how the time grows with
    the prompt: :meth:`disagg.measurements.PrefillMeasurement.fit`)
    and its decode step (:func:`probe_decode_step`: ``count`` short and
    ``count`` long prompts, the long ones ``prefill_tokens`` at most ``max_model_len`` -
    :data:`DECODE_PROBE_OUTPUT`), and store both for ``disagg plan``
    (:func:`disagg.measurements.store_prefill`, :func:`disagg.measurements.store_decode`); ``where``
    (the topology file) goes into their sources. Returns what was stored, for results.json.
    Called by ``disagg bench prefill`` (:mod:`disagg.commands.bench`) and ``disagg bench compare``
    (:mod:`disagg.bench.compare`)."""
    kind = engine_words(connector)
    rate = await probe_prefill_rate(url, model, prefill_tokens, count, seed=seed, headers=headers)
    points = [(float(prefill_tokens), prefill_tokens / rate)]
    short = prefill_tokens // PREFILL_SHORT_DIVISOR
    lengths = f"{prefill_tokens} tokens"
    if short >= PREFILL_SHORT_MIN:          # how the time grows with the prompt (attention's square part)
        short_rate = await probe_prefill_rate(url, model, short, count, seed=seed + 1, headers=headers)
        points.append((float(short), short / short_rate))
        lengths = f"{prefill_tokens} and {count} of {short} tokens"
    source = (f"prefill probe: {count} prompts of {lengths}, max_tokens 1, concurrency 1, straight "
              f"to {engine} at {url}, {kind} ({where})")
    path = store_prefill(run_dir, model, host, rate, source, dtype=dtype, connector=connector, points=points)
    out: dict[str, Any] = {"engine": engine, "connector": connector, "prompt_tokens_per_s": rate,
                           "prefill_points": [list(p) for p in points], "file": str(path)}
    decode = await _probe_decode(run_dir, model, dtype, host, engine, url, connector, prefill_tokens, count,
                                 kv_bytes, where, kind, seed, headers, max_model_len)
    out["decode"] = decode
    return out


async def _probe_decode(run_dir: str, model: str, dtype: str, host: str, engine: str, url: str, connector: str,
                        prefill_tokens: int, count: int, kv_bytes: Callable[[int], float], where: str, kind: str,
                        seed: int, headers: Mapping[str, str] | None,
                        max_model_len: int | None) -> dict[str, Any]:
    """:func:`probe_engine`'s decode part: the decode probe, fitted and stored; what was stored."""
    long_tokens = prefill_tokens if max_model_len is None else min(prefill_tokens,
                                                                    max_model_len - DECODE_PROBE_OUTPUT)
    if long_tokens <= DECODE_PROBE_SHORT:
        return {"stored": False, "why": f"the long prompt ({long_tokens} tokens) is no longer than the "
                                        f"short one ({DECODE_PROBE_SHORT})"}
    points = await probe_decode_step(url, model, long_tokens, count=max(1, min(count, 2)), seed=seed,
                                     headers=headers)
    fixed, per_byte, xy = fit_decode(points, kv_bytes)
    source = (f"decode probe: {len(points)} requests of {DECODE_PROBE_SHORT} and {long_tokens}-token prompts, "
              f"{DECODE_PROBE_OUTPUT} tokens each (ignore_eos), one at a time, straight to {engine} at {url}, "
              f"{kind} ({where})")
    path = store_decode(run_dir, model, host, fixed, per_byte, source, points=xy, dtype=dtype, connector=connector)
    return {"stored": True, "fixed_s": fixed, "per_kv_byte_s": per_byte,
            "points": [{"prompt_tokens": p.prompt_tokens, "output_tokens": p.output_tokens,
                        "kv_bytes": x, "tpot_s": p.tpot_s} for p, (x, _) in zip(points, xy, strict=True)],
            "file": str(path)}
