"""One scrape of a run: the proxy's and every engine's ``/metrics``, every engine's ``/health``.

Callers: :mod:`disagg.watch.top`, once per refresh. The requests go out at once (a thread each)
and each waits at most ``timeout`` seconds, so one engine that does not answer delays a refresh by
that much, never more. ``/metrics`` and ``/health`` answer without the run's engine key (the
engine guard leaves read-only probes open: ``connectors/engine_guard.py``), and the proxy's
``/metrics`` without its API key, so no secret is needed here.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from disagg.launch.state import ProcessRecord, RunState
from disagg.watch.metrics import Metrics, MetricsError
from disagg.watch.snapshot import Process, Scrape

#: the most of a ``/metrics`` answer read (vLLM's is some 100 kB)
MAX_METRICS_BYTES = 8 * 2**20
#: seconds one request may take
DEFAULT_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Answer:
    """One GET: the status (None: no answer) and the body, or why there is none."""

    status: int | None
    body: str = ""
    error: str | None = None


def get(url: str, timeout: float, limit: int = MAX_METRICS_BYTES) -> Answer:
    """GET ``url`` within ``timeout``; never raises."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            data = resp.read(limit + 1)
            if len(data) > limit:
                return Answer(int(resp.status), error=f"answer larger than {limit} bytes")
            return Answer(int(resp.status), data.decode("utf-8", errors="replace"))
    except urllib.error.HTTPError as exc:
        return Answer(int(exc.code), error=f"HTTP {exc.code}")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        return Answer(None, error=str(reason))


def _metrics(answer: Answer) -> tuple[Metrics | None, str | None]:
    if answer.error is not None:
        return None, answer.error
    if answer.status != 200:
        return None, f"HTTP {answer.status}"
    try:
        return Metrics.parse(answer.body), None
    except MetricsError as exc:
        return None, str(exc)


def engines(run: RunState) -> list[ProcessRecord]:
    """The run's engines, in the state file's order."""
    return [rec for rec in run.processes if rec.kind == "engine"]


def processes(run: RunState) -> list[Process]:
    """The run's engines as :mod:`disagg.watch.snapshot` sees them."""
    return [Process(rec.name, rec.host, rec.status, rec.restarts) for rec in engines(run)]


def scrape(run: RunState, timeout: float = DEFAULT_TIMEOUT_S) -> Scrape:
    """Every ``/metrics`` and ``/health`` of ``run`` at once; the scrape's time is when they went out."""
    recs = engines(run)
    urls = [run.proxy_url.rstrip("/") + "/metrics"]
    for rec in recs:
        urls += [rec.url.rstrip("/") + "/metrics", rec.url.rstrip("/") + "/health"]
    at = time.monotonic()
    with ThreadPoolExecutor(max_workers=min(32, len(urls))) as pool:
        answers = list(pool.map(lambda url: get(url, timeout), urls))
    proxy, proxy_error = _metrics(answers[0])
    errors: dict[str, str] = {}
    if proxy_error is not None:
        errors["proxy"] = proxy_error
    texts: dict[str, Metrics | None] = {}
    health: dict[str, int | None] = {}
    for i, rec in enumerate(recs):
        texts[rec.name], error = _metrics(answers[1 + 2 * i])
        health[rec.name] = answers[2 + 2 * i].status
        if error is not None:
            errors[rec.name] = error
    return Scrape(at=at, proxy=proxy, engines=texts, health=health, errors=errors)
