"""A snapshot of a running topology from scrapes of its ``/metrics`` (pure: no I/O).

Callers: :mod:`disagg.watch.top` builds one per refresh from three scrapes of the same run
(:class:`Scrape`, made by :mod:`disagg.watch.scrape`): the current one, the one before it
(rates: requests and routing decisions per second, handoff bytes per second) and the oldest
one kept of the last minute (distributions: TTFT/TPOT percentiles, route mix, fallbacks,
errors). Without that window base the distributions are since the proxy started, and the
snapshot says so. Tests build scrapes from captured metrics text.

What is read (names as exported; see :mod:`disagg.proxy.metrics` and vLLM's ``/metrics``):

- proxy: ``disagg_proxy_ttft_seconds`` / ``disagg_proxy_tpot_seconds`` (histograms),
  ``disagg_proxy_requests_total{path}``, ``disagg_route_total{path, reason}``,
  ``disagg_proxy_fallbacks_total{reason}``, ``disagg_proxy_upstream_errors_total{role, kind}``,
  ``disagg_proxy_rejected_total{reason}``, ``disagg_proxy_active_requests``;
- engines (vLLM): ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
  ``vllm:kv_cache_usage_perc`` (older vLLM: ``vllm:gpu_cache_usage_perc``), and the bytes the
  KV connector moved: ``vllm:nixl_bytes_transferred_sum`` (NIXL, the side that moves the
  blocks) and ``vllm:socket_kv_bytes_received_total`` (socket connector, decode side).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from disagg.watch.metrics import Metrics

TTFT = "disagg_proxy_ttft_seconds"
TPOT = "disagg_proxy_tpot_seconds"
REQUESTS = "disagg_proxy_requests_total"
ROUTES = "disagg_route_total"
FALLBACKS = "disagg_proxy_fallbacks_total"
UPSTREAM_ERRORS = "disagg_proxy_upstream_errors_total"
REJECTED = "disagg_proxy_rejected_total"
ACTIVE = "disagg_proxy_active_requests"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
#: KV-cache use (0..1), newest name first
KV_USE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
#: cumulative KV bytes moved by an engine's connector (each transfer counted on one side only)
HANDOFF_BYTES = ("vllm:nixl_bytes_transferred_sum", "vllm:socket_kv_bytes_received_total")


@dataclass(frozen=True)
class Process:
    """One engine of the run as its state file records it."""

    name: str          # prefill[0], decode[0], both[0]
    host: str
    status: str        # the supervisor's: running, backoff, starting, failed
    restarts: int

    @property
    def role(self) -> str:
        """``prefill[0]`` -> ``prefill``."""
        return self.name.partition("[")[0]


@dataclass(frozen=True)
class Scrape:
    """What one round of requests found, at ``at`` (monotonic seconds)."""

    at: float
    proxy: Metrics | None                        # None: no answer or not Prometheus text
    engines: Mapping[str, Metrics | None]        # by process name
    health: Mapping[str, int | None]             # /health status by process name (None: no answer)
    errors: Mapping[str, str] = field(default_factory=dict)   # by process name, or "proxy"


@dataclass(frozen=True)
class Latency:
    """Percentiles of one histogram over the window (None without samples)."""

    p50: float | None
    p99: float | None
    count: int


@dataclass(frozen=True)
class EngineRow:
    """One engine's line."""

    name: str
    role: str
    host: str
    status: str
    restarts: int
    healthy: bool | None        # /health answered 200 (None: no answer at all)
    running: float | None
    waiting: float | None
    kv_use: float | None        # 0..1
    error: str | None


@dataclass(frozen=True)
class Snapshot:
    """Everything ``disagg top`` shows."""

    run: str
    proxy_url: str
    proxy_error: str | None
    rate_interval_s: float | None           # rates are over this (None: one scrape only)
    window_s: float | None                  # distributions are over this (None: since the proxy started)
    active_requests: float | None
    requests_per_s: float | None
    decisions_per_s: float | None
    handoff_bytes_per_s: float | None
    ttft: Latency
    tpot: Latency
    routes: dict[str, float]                # prompts by path over the window
    route_reasons: dict[str, float]         # "path/reason" -> prompts over the window
    fallbacks: dict[str, float]             # by reason over the window
    errors: dict[str, float]                # "error requests", "upstream role/kind", "rejected reason"
    engines: list[EngineRow]

    @property
    def window(self) -> str:
        """How the distributions' window reads: ``last 60 s`` or ``since the proxy started``."""
        return "since the proxy started" if self.window_s is None else f"last {self.window_s:.0f} s"

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` form (seconds, bytes, fractions; null where unknown)."""
        def latency(lat: Latency) -> dict[str, Any]:
            return {"p50": lat.p50, "p99": lat.p99, "count": lat.count}
        return {
            "run": self.run,
            "proxy": {"url": self.proxy_url, "up": self.proxy_error is None, "error": self.proxy_error,
                      "active_requests": self.active_requests},
            "rates": {"interval_s": self.rate_interval_s, "requests_per_s": self.requests_per_s,
                      "decisions_per_s": self.decisions_per_s, "handoff_bytes_per_s": self.handoff_bytes_per_s},
            "window": {"description": self.window, "seconds": self.window_s},
            "ttft_s": latency(self.ttft),
            "tpot_s": latency(self.tpot),
            "routes": self.routes,
            "route_reasons": self.route_reasons,
            "fallbacks": self.fallbacks,
            "errors": self.errors,
            "engines": [{"name": e.name, "role": e.role, "host": e.host, "status": e.status,
                         "restarts": e.restarts, "healthy": e.healthy, "running": e.running,
                         "waiting": e.waiting, "kv_use": e.kv_use, "error": e.error} for e in self.engines],
        }


def histogram_quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """The ``q`` quantile of cumulative ``buckets`` (upper bound -> count), as Prometheus'
    ``histogram_quantile`` computes it: linear within the bucket it falls in; in the ``+Inf``
    bucket, the highest finite bound. None without samples."""
    bounds = sorted(buckets)
    if not bounds:
        return None
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def _delta_buckets(now: Mapping[float, float], base: Mapping[float, float] | None) -> dict[float, float]:
    """Bucket counts added since ``base``; the counts themselves when a counter went back (restart)."""
    if base is None:
        return dict(now)
    delta = {b: c - base.get(b, 0.0) for b, c in now.items()}
    return dict(now) if any(v < 0 for v in delta.values()) else delta


def _delta(now: float, base: float | None) -> float:
    """Counter increase since ``base`` (a counter that went back started again: its value)."""
    if base is None:
        return now
    return now if now < base else now - base


def _latency(name: str, now: Metrics | None, base: Metrics | None) -> Latency:
    if now is None:
        return Latency(None, None, 0)
    buckets = _delta_buckets(now.buckets(name), base.buckets(name) if base is not None else None)
    count = round(max(buckets.values(), default=0.0))
    return Latency(histogram_quantile(0.5, buckets), histogram_quantile(0.99, buckets), count)


def _labelled(name: str, keys: Sequence[str], now: Metrics | None, base: Metrics | None,
              sep: str = "/") -> dict[str, float]:
    """Increase of a labelled counter since ``base`` per label values joined by ``sep``; zeros left out."""
    if now is None:
        return {}
    before = base.by_labels(name, *keys) if base is not None else {}
    out: dict[str, float] = {}
    for labels, value in sorted(now.by_labels(name, *keys).items()):
        increase = _delta(value, before.get(labels))
        if increase > 0:
            out[sep.join(labels)] = increase
    return out


def _rate(name: str, now: Metrics | None, prev: Metrics | None, dt: float | None) -> float | None:
    if now is None or prev is None or not dt:
        return None
    return _delta(now.total(name), prev.total(name)) / dt


def _handoff_rate(now: Scrape, prev: Scrape | None, dt: float | None) -> float | None:
    """KV bytes per second every engine's connector moved between the two scrapes (None when no
    engine exports a connector byte counter in both)."""
    if prev is None or not dt:
        return None
    moved, seen = 0.0, False
    for name, metrics in now.engines.items():
        before = prev.engines.get(name)
        if metrics is None or before is None:
            continue
        for counter in HANDOFF_BYTES:
            if metrics.has(counter):
                seen = True
                moved += _delta(metrics.total(counter), before.total(counter) if before.has(counter) else 0.0)
    return moved / dt if seen else None


def _kv_use(metrics: Metrics) -> float | None:
    for name in KV_USE:
        values = [s.value for s in metrics.samples if s.name == name]
        if values:
            return max(values)   # data-parallel engines: the fullest
    return None


def _engine(proc: Process, now: Scrape) -> EngineRow:
    metrics = now.engines.get(proc.name)
    code = now.health.get(proc.name)
    return EngineRow(
        name=proc.name, role=proc.role, host=proc.host, status=proc.status, restarts=proc.restarts,
        healthy=None if code is None else code == 200,
        running=metrics.first(RUNNING) if metrics is not None else None,
        waiting=metrics.first(WAITING) if metrics is not None else None,
        kv_use=_kv_use(metrics) if metrics is not None else None,
        error=now.errors.get(proc.name))


def build_snapshot(run: str, proxy_url: str, processes: Sequence[Process], now: Scrape,
                   previous: Scrape | None = None, window: Scrape | None = None) -> Snapshot:
    """The snapshot at ``now``: rates since ``previous``, distributions since ``window`` (None:
    since the proxy started)."""
    dt = now.at - previous.at if previous is not None and now.at > previous.at else None
    prev = previous.proxy if previous is not None else None
    base = window.proxy if window is not None else None
    if window is not None and base is None and now.proxy is not None:
        window = None    # the proxy did not answer then: count from its start instead
    proxy = now.proxy
    errors: dict[str, float] = {}
    failed = _labelled(REQUESTS, ("path",), proxy, base).get("error")
    if failed:
        errors["error requests"] = failed
    errors.update({f"upstream {k}": v for k, v in _labelled(UPSTREAM_ERRORS, ("role", "kind"), proxy, base).items()})
    errors.update({f"rejected {k}": v for k, v in _labelled(REJECTED, ("reason",), proxy, base).items()})
    return Snapshot(
        run=run, proxy_url=proxy_url, proxy_error=now.errors.get("proxy") if proxy is None else None,
        rate_interval_s=dt,
        window_s=now.at - window.at if window is not None else None,
        active_requests=proxy.first(ACTIVE) if proxy is not None else None,
        requests_per_s=_rate(REQUESTS, proxy, prev, dt),
        decisions_per_s=_rate(ROUTES, proxy, prev, dt),
        handoff_bytes_per_s=_handoff_rate(now, previous, dt),
        ttft=_latency(TTFT, proxy, base),
        tpot=_latency(TPOT, proxy, base),
        routes=_labelled(ROUTES, ("path",), proxy, base),
        route_reasons=_labelled(ROUTES, ("path", "reason"), proxy, base),
        fallbacks=_labelled(FALLBACKS, ("reason",), proxy, base),
        errors=errors,
        engines=[_engine(p, now) for p in processes])
