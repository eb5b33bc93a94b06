"""The proxy's route mix and prediction quality over one measured run.

:func:`disagg.bench.runner.run_sweep` scrapes the target's ``GET /metrics``
before and after each measured run (:func:`scrape`) and keeps the difference
(:func:`route_delta`) in the run's record. The series are the builtin proxy's
routing metrics (:mod:`disagg.proxy.metrics`):

- ``disagg_route_total{path, reason}``: prompts by the path chosen and why;
- ``disagg_route_predicted_ttft_seconds{path}`` and
  ``disagg_route_observed_ttft_seconds{path}``: histograms whose ``_sum`` and
  ``_count`` deltas give the mean predicted and the mean observed TTFT per path;
- ``disagg_route_ttft_error_ratio{path}``: per prompt |predicted - observed| /
  observed, whose deltas give the mean absolute relative error per path.

A server without them (a plain vLLM server, a proxy without routing) gives
``None`` and the report leaves the section out. The raw deltas of several runs
(the repeats of one step) add up (:func:`merge_deltas`); :func:`route_summary`
turns raw deltas into shares, means and the relative error of the prediction.
The report module (:mod:`disagg.bench.report`) calls both.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

ROUTE_TOTAL = "disagg_route_total"
PREDICTED = "disagg_route_predicted_ttft_seconds"
OBSERVED = "disagg_route_observed_ttft_seconds"
ERROR = "disagg_route_ttft_error_ratio"


@dataclass(frozen=True)
class RouteCounters:
    """The routing series of one ``/metrics`` page (cumulative since the proxy started)."""

    routes: dict[tuple[str, str], float] = field(default_factory=dict)        # (path, reason) -> prompts
    predicted: dict[str, tuple[float, float]] = field(default_factory=dict)   # path -> (sum s, count)
    observed: dict[str, tuple[float, float]] = field(default_factory=dict)
    error: dict[str, tuple[float, float]] = field(default_factory=dict)       # path -> (sum of ratios, count)

    @property
    def empty(self) -> bool:
        """True when the page had none of the routing series."""
        return not (self.routes or self.predicted or self.observed)


def parse_route_counters(text: str) -> RouteCounters:
    """The routing series of a Prometheus text page (prometheus-client's parser, as
    :mod:`disagg.prometheus_text` uses); series that are absent are simply missing."""
    routes: dict[tuple[str, str], float] = {}
    hists: dict[str, dict[str, list[float]]] = {PREDICTED: {}, OBSERVED: {}, ERROR: {}}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == ROUTE_TOTAL:
                key = (labels.get("path", ""), labels.get("reason", ""))
                routes[key] = routes.get(key, 0.0) + float(sample.value)
                continue
            for base, by_path in hists.items():
                for slot, suffix in enumerate(("_sum", "_count")):
                    if sample.name == base + suffix:
                        pair = by_path.setdefault(labels.get("path", ""), [0.0, 0.0])
                        pair[slot] += float(sample.value)
    return RouteCounters(routes=routes,
                         predicted={p: (v[0], v[1]) for p, v in hists[PREDICTED].items()},
                         observed={p: (v[0], v[1]) for p, v in hists[OBSERVED].items()},
                         error={p: (v[0], v[1]) for p, v in hists[ERROR].items()})


async def scrape(session: aiohttp.ClientSession, base_url: str, timeout_s: float = 10.0) -> RouteCounters | None:
    """``GET base_url/metrics`` parsed by :func:`parse_route_counters`; None when the page is
    missing, unreadable or has no routing series (a plain vLLM server). Never raises."""
    try:
        async with session.get(base_url + "/metrics", timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                return None
            text = await resp.text()
        counters = parse_route_counters(text)
    except (TimeoutError, aiohttp.ClientError, ValueError, UnicodeDecodeError):
        return None
    return None if counters.empty else counters


def _diff(after: float, before: float) -> float:
    # a counter that went down means the proxy restarted in between: count from zero
    return after - before if after >= before else after


def route_delta(before: RouteCounters | None, after: RouteCounters | None) -> dict[str, Any] | None:
    """What happened between two scrapes, JSON-ready::

        {"routes": {path: {reason: prompts}},
         "predicted_ttft": {path: {"sum_s": ..., "count": ...}}, "observed_ttft": {...},
         "error_ratio": {path: {"sum_s": sum of |pred - obs| / obs, "count": ...}}}

    None when the second scrape found no routing series. A missing first scrape counts from zero."""
    if after is None:
        return None
    before = before or RouteCounters()
    routes: dict[str, dict[str, float]] = {}
    for (path, reason), value in sorted(after.routes.items()):
        n = _diff(value, before.routes.get((path, reason), 0.0))
        if n:
            routes.setdefault(path, {})[reason] = n
    out: dict[str, Any] = {"routes": routes}
    for key, now, then in (("predicted_ttft", after.predicted, before.predicted),
                           ("observed_ttft", after.observed, before.observed),
                           ("error_ratio", after.error, before.error)):
        out[key] = {}
        for path, (total, count) in sorted(now.items()):
            old = then.get(path, (0.0, 0.0))
            n = _diff(count, old[1])
            if n:
                out[key][path] = {"sum_s": total - old[0] if count >= old[1] else total, "count": n}
    return out


def merge_deltas(deltas: Iterable[Mapping[str, Any] | None]) -> dict[str, Any] | None:
    """The sum of several :func:`route_delta` results (the repeats of one step); None when all are None."""
    found = [d for d in deltas if d is not None]
    if not found:
        return None
    out: dict[str, Any] = {"routes": {}, "predicted_ttft": {}, "observed_ttft": {}, "error_ratio": {}}
    for d in found:
        for path, reasons in d.get("routes", {}).items():
            mine = out["routes"].setdefault(path, {})
            for reason, n in reasons.items():
                mine[reason] = mine.get(reason, 0.0) + n
        for key in ("predicted_ttft", "observed_ttft", "error_ratio"):
            for path, h in d.get(key, {}).items():
                mine = out[key].setdefault(path, {"sum_s": 0.0, "count": 0.0})
                mine["sum_s"] += h["sum_s"]
                mine["count"] += h["count"]
    return out


def route_summary(delta: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Per path: ``prompts``, ``share`` of all routed prompts, ``reasons``, ``predicted_ttft_ms`` and
    ``observed_ttft_ms`` (means; None without observations) and ``relative_error``
    ((predicted - observed) / observed of the means; None unless both are known) and
    ``mean_abs_error`` (the mean over prompts of |predicted - observed| / observed; None when the
    proxy does not export it)."""
    routes: Mapping[str, Mapping[str, float]] = delta.get("routes", {})
    total = sum(sum(r.values()) for r in routes.values())
    paths = sorted(set(routes) | set(delta.get("predicted_ttft", {})) | set(delta.get("observed_ttft", {})))
    out: dict[str, dict[str, Any]] = {}
    for path in paths:
        prompts = sum(routes.get(path, {}).values())
        means: dict[str, float | None] = {}
        for key in ("predicted_ttft", "observed_ttft"):
            h = delta.get(key, {}).get(path)
            means[key] = 1000 * h["sum_s"] / h["count"] if h and h["count"] else None
        pred, obs = means["predicted_ttft"], means["observed_ttft"]
        e = delta.get("error_ratio", {}).get(path)
        out[path] = {"prompts": prompts, "share": prompts / total if total else None,
                     "reasons": dict(routes.get(path, {})),
                     "predicted_ttft_ms": pred, "observed_ttft_ms": obs,
                     "relative_error": (pred - obs) / obs if pred is not None and obs else None,
                     "mean_abs_error": e["sum_s"] / e["count"] if e and e["count"] else None}
    return out
