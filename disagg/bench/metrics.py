"""Benchmark arithmetic, with ``vllm bench serve``'s definitions (vllm/benchmarks/serve.py,
``calculate_metrics``). Pure functions: no I/O, no clocks.

- TTFT: first token chunk - send.
- TPOT: (E2EL - TTFT) / (output tokens - 1), only for requests with more than
  one output token; for goodput a request with one token has TPOT 0.
- ITL: every gap between successive token chunks, pooled over all requests.
- E2EL: last token chunk - send.
- Throughputs divide by the run's duration (first send to last completion).
- Goodput: completed requests/s that meet every SLO given; SLO attainment is
  the share of all requests (failed ones count as missed) that met them.
- Percentiles: numpy's default ("linear") method, as vLLM uses.
- Failures are counted by kind (:func:`failure_kind`): the HTTP status of a
  refused request (the proxy's 429 at its concurrency cap, 503 with no healthy
  backend), else ``stream``, ``timeout`` or ``connection``.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from disagg.bench.records import RequestRecord
from disagg.bench.slo import NO_SLO, SLO, SLO_METRICS

DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)


def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (0..100), numpy's default ("linear") method as vLLM computes it.
    An empty sequence gives 0.0 (as vLLM reports it)."""
    if not 0.0 <= p <= 100.0:
        raise ValueError(f"percentile {p} outside 0..100")
    if not values:
        return 0.0
    return float(np.percentile(values, p))


def tpot(e2el: float, ttft: float, output_tokens: int) -> float | None:
    """Time per output token after the first, s; None when there is at most one token."""
    if output_tokens <= 1:
        return None
    return (e2el - ttft) / (output_tokens - 1)


def pooled_itls(records: Iterable[RequestRecord]) -> list[float]:
    """Every inter-token gap of every successful request, in request order."""
    out: list[float] = []
    for rec in records:
        if rec.success:
            out.extend(rec.itls)
    return out


def failure_kind(error: str) -> str:
    """What a failed request's recorded error (:mod:`disagg.bench.client`) says went wrong:
    ``"HTTP 429"`` for an HTTP status, ``"stream"`` (an error event, or no token), ``"timeout"``,
    ``"connection"``, else ``"other"``. Called per failed record by :func:`compute_metrics`."""
    if m := re.match(r"HTTP (\d{3})\b", error):
        return f"HTTP {m.group(1)}"
    if error.startswith(("stream error", "the stream ended")):
        return "stream"
    if error.startswith("TimeoutError"):
        return "timeout"
    if error.startswith(("Client", "Server")):      # aiohttp's ClientConnectorError, ServerDisconnectedError ...
        return "connection"
    return "other"


def missed_limits(slo: SLO, ttft: float, tpot_s: float | None, e2el: float) -> list[str]:
    """The limits set in ``slo`` (``ttft``, ``tpot``, ``e2el``, in that order) that one completed
    request exceeds (TPOT None counts as 0, as vLLM)."""
    values = {"ttft": ttft, "tpot": tpot_s or 0.0, "e2el": e2el}
    return [name for name in SLO_METRICS if (limit := getattr(slo, name)) is not None and values[name] > limit]


def meets_slo(slo: SLO, ttft: float, tpot_s: float | None, e2el: float) -> bool:
    """Whether one completed request meets every limit set (:func:`missed_limits` finds none)."""
    return not missed_limits(slo, ttft, tpot_s, e2el)


@dataclass(frozen=True)
class Distribution:
    """Summary of one latency metric, seconds."""

    count: int
    mean: float
    std: float
    median: float
    percentiles: dict[float, float] = field(default_factory=dict)

    @classmethod
    def of(cls, values: Sequence[float], percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> Distribution:
        """Summarise ``values``; an empty sequence gives zeros (vLLM's convention)."""
        n = len(values)
        mean = sum(values) / n if n else 0.0
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / n) if n else 0.0
        return cls(count=n, mean=mean, std=std, median=percentile(values, 50.0),
                   percentiles={float(p): percentile(values, p) for p in percentiles})

    def p(self, q: float) -> float:
        """The stored ``q``-th percentile."""
        return self.percentiles[float(q)]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, in milliseconds (``mean_ms``, ``p99_ms`` ...)."""
        d: dict[str, Any] = {"count": self.count, "mean_ms": self.mean * 1000, "std_ms": self.std * 1000,
                             "median_ms": self.median * 1000}
        for q, v in self.percentiles.items():
            d[f"p{q:g}_ms"] = v * 1000
        return d


@dataclass(frozen=True)
class Metrics:
    """Everything reported for one set of requests over one run duration."""

    requests: int
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float          # completed / duration
    output_throughput: float           # output tokens / duration
    total_token_throughput: float      # (input + output tokens) / duration
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2el: Distribution
    good: int | None                   # requests meeting the SLO (None: no SLO)
    goodput: float | None              # good / duration
    slo_attainment: float | None       # good / requests
    failures: dict[str, int] = field(default_factory=dict)   # failed requests by failure_kind

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (latencies in ms)."""
        return {"requests": self.requests, "completed": self.completed, "failed": self.failed,
                "duration_s": self.duration_s, "total_input_tokens": self.total_input_tokens,
                "total_output_tokens": self.total_output_tokens,
                "request_throughput": self.request_throughput, "output_throughput": self.output_throughput,
                "total_token_throughput": self.total_token_throughput,
                "ttft": self.ttft.to_dict(), "tpot": self.tpot.to_dict(), "itl": self.itl.to_dict(),
                "e2el": self.e2el.to_dict(), "good": self.good, "goodput": self.goodput,
                "slo_attainment": self.slo_attainment, "failures": dict(self.failures)}


def compute_metrics(records: Sequence[RequestRecord], duration_s: float, slo: SLO = NO_SLO,
                    percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> Metrics:
    """Aggregate ``records`` of one run lasting ``duration_s`` seconds."""
    if duration_s <= 0:
        raise ValueError(f"run duration must be positive, got {duration_s}")
    ttfts: list[float] = []
    tpots: list[float] = []
    e2els: list[float] = []
    total_in = total_out = good = 0
    done = [r for r in records if r.success]
    for rec in done:
        ttft, e2el = rec.ttft, rec.e2el
        assert ttft is not None and e2el is not None   # success implies chunks
        out = rec.output_tokens
        per_token = tpot(e2el, ttft, out)
        if per_token is not None:
            tpots.append(per_token)
        ttfts.append(ttft)
        e2els.append(e2el)
        total_in += rec.prompt_tokens
        total_out += out
        if not slo.empty and meets_slo(slo, ttft, per_token, e2el):
            good += 1
    n = len(records)
    return Metrics(
        requests=n, completed=len(done), failed=n - len(done), duration_s=duration_s,
        total_input_tokens=total_in, total_output_tokens=total_out,
        request_throughput=len(done) / duration_s, output_throughput=total_out / duration_s,
        total_token_throughput=(total_in + total_out) / duration_s,
        ttft=Distribution.of(ttfts, percentiles), tpot=Distribution.of(tpots, percentiles),
        itl=Distribution.of(pooled_itls(done), percentiles), e2el=Distribution.of(e2els, percentiles),
        good=None if slo.empty else good,
        goodput=None if slo.empty else good / duration_s,
        slo_attainment=None if slo.empty or n == 0 else good / n,
        failures=dict(sorted(Counter(failure_kind(r.error or "") for r in records if not r.success).items())))


def metrics_by_class(records: Sequence[RequestRecord], duration_s: float, slo: SLO = NO_SLO,
                     percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict[str, Metrics]:
    """``{"all": ..., "<class>": ...}``; per-class throughputs use the whole run's duration."""
    out = {"all": compute_metrics(records, duration_s, slo, percentiles)}
    for klass in sorted({r.klass for r in records}):
        out[klass] = compute_metrics([r for r in records if r.klass == klass], duration_s, slo, percentiles)
    return out
