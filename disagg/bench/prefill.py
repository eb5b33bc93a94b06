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
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import aiohttp

from disagg.bench.client import COMPLETIONS_PATH, send_request
from disagg.bench.prompts import build_prompts
from disagg.bench.records import RequestRecord
from disagg.bench.workload import PromptClass, Workload
from disagg.errors import DisaggError


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
