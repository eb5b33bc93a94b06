"""Run a workload against one endpoint: one run per request rate (open loop) or per
concurrency (closed loop), each with fresh prompts so the prefix cache of an
earlier run cannot help a later one.

With ``repeats`` > 1 every step is run that many times back to back; repeat k
uses the workload's seed + k and a salt of its own (:func:`repeat_workload`),
so repeats differ in class order, arrivals and prompts and never hit each
other's prefix cache, while every endpoint of a compare sees the same repeats.
Around every run the target's ``/metrics`` is scraped for the proxy's route
mix (:mod:`disagg.bench.routes`). Called by ``disagg bench serve``
(:mod:`disagg.commands.bench`) and by :mod:`disagg.bench.compare`.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import aiohttp

from disagg.bench.client import CHAT_PATH, COMPLETIONS_PATH, send_request
from disagg.bench.metrics import DEFAULT_PERCENTILES, Metrics, metrics_by_class
from disagg.bench.progress import Progress
from disagg.bench.prompts import DEFAULT_CHARS_PER_TOKEN, Prompt, build_prompts
from disagg.bench.records import RequestRecord
from disagg.bench.routes import route_delta, scrape
from disagg.bench.slo import NO_SLO, SLO
from disagg.bench.workload import Workload, arrival_offsets, class_sequence
from disagg.errors import DisaggError


def normalize_base_url(url: str) -> str:
    """``http://h:8000/v1/`` -> ``http://h:8000`` (the server root)."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise DisaggError(f"bad endpoint URL {url!r}: expected http://HOST:PORT")
    return url.removesuffix("/v1")


@dataclass(frozen=True)
class Target:
    """Where to send requests."""

    base_url: str                           # server root, e.g. http://127.0.0.1:8000
    model: str | None = None                # None: the first model of GET /v1/models
    tokenize_urls: tuple[str, ...] | None = ()   # servers with /tokenize, tried in order; () = base_url;
                                                 # None = never tokenize (chars-per-token estimate)
    headers: tuple[tuple[str, str], ...] = ()
    chars_per_token: float = DEFAULT_CHARS_PER_TOKEN


@dataclass(frozen=True)
class Step:
    """One point of a sweep: an open-loop rate (req/s, inf = all at once), a closed-loop concurrency,
    or a trace replayed at a time scale (2 = twice as fast; ``concurrency`` then an optional cap)."""

    rate: float | None = None
    concurrency: int | None = None
    time_scale: float | None = None

    @property
    def label(self) -> str:
        if self.time_scale is not None:
            return f"trace x{self.time_scale:g}"
        if self.rate is None:
            return f"concurrency {self.concurrency}"
        return "rate inf" if math.isinf(self.rate) else f"rate {self.rate:g}/s"


@dataclass
class RunResult:
    """One run: its step, every request's record and the metrics per class."""

    step: Step
    started_at: str
    duration_s: float
    records: list[RequestRecord]
    metrics: dict[str, Metrics] = field(default_factory=dict)
    exact_prompts: bool = False
    repeat: int = 0                         # which repeat of its step (0-based)
    routes: dict[str, Any] | None = None    # the proxy's route deltas over the run (routes.route_delta)
    #: the machine's 1-minute load average as the run started and as it ended (what else ran
    #: beside the benchmark; the engines under test add their own)
    loadavg: tuple[float, float] | None = None
    #: trace requests cut to the server's max_model_len (None: not a trace, or max_model_len unknown)
    capped: int | None = None

    @property
    def x(self) -> float:
        """Where this run sits on a 'vs request rate' axis: the offered rate, or for a
        closed loop (or rate inf) the achieved request throughput."""
        if self.step.rate is not None and not math.isinf(self.step.rate):
            return self.step.rate
        return self.metrics["all"].request_throughput

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, with every record."""
        rate = self.step.rate
        d: dict[str, Any] = {
            "label": self.step.label, "rate": "inf" if rate is not None and math.isinf(rate) else rate,
            "concurrency": self.step.concurrency, "time_scale": self.step.time_scale, "capped": self.capped,
            "repeat": self.repeat, "x": self.x,
            "started_at": self.started_at, "duration_s": self.duration_s, "exact_prompts": self.exact_prompts,
            "loadavg": list(self.loadavg) if self.loadavg is not None else None,
            "metrics": {k: m.to_dict() for k, m in self.metrics.items()}}
        if self.routes is not None:
            d["routes"] = self.routes
        d["records"] = [r.to_dict() for r in self.records]
        return d


@dataclass
class BenchResult:
    """A sweep against one endpoint."""

    base_url: str
    model: str
    workload: Workload
    slo: SLO
    runs: list[RunResult]                   # each step's repeats back to back, steps in order
    repeats: int = 1

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        w = self.workload
        return {"base_url": self.base_url, "model": self.model, "slo": self.slo.to_dict(), "repeats": self.repeats,
                "workload": {"classes": [vars(c) for c in w.classes], "num_requests": w.num_requests,
                             "duration_s": w.duration_s, "arrival": w.arrival, "burstiness": w.burstiness,
                             "concurrency": w.concurrency, "seed": w.seed, "salt": w.salt, "api": w.api,
                             "ignore_eos": w.ignore_eos, "temperature": w.temperature,
                             "trace": w.trace.to_dict() if w.trace is not None else None},
                "runs": [r.to_dict() for r in self.runs]}


async def resolve_model(session: aiohttp.ClientSession, base_url: str) -> str:
    """The first model id served at ``base_url`` (GET /v1/models)."""
    url = base_url + "/v1/models"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=30)) as resp:
            if resp.status != 200:
                raise DisaggError(f"{url} answered HTTP {resp.status}: {(await resp.text())[:200]}")
            data = await resp.json()
    except (TimeoutError, aiohttp.ClientError) as exc:
        raise DisaggError(f"cannot reach {url}: {exc}") from exc
    models = data.get("data") or []
    if not models:
        raise DisaggError(f"{url} lists no model; pass --model")
    return str(models[0]["id"])


async def run_step(session: aiohttp.ClientSession, url: str, model: str, prompts: Sequence[Prompt],
                   workload: Workload, step: Step, slo: SLO, headers: dict[str, str] | None = None,
                   progress: bool = True, percentiles: Sequence[float] = DEFAULT_PERCENTILES,
                   title: str | None = None) -> RunResult:
    """Send ``prompts`` to ``url`` at ``step``'s rate or concurrency; gather the records.
    ``title`` names the run on the progress bar (default: the step's label)."""
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    load_start = os.getloadavg()[0]
    bar = Progress(len(prompts), f"{title or step.label:>16}", enabled=progress)
    records: list[RequestRecord] = []
    t0 = time.perf_counter()
    deadline = workload.duration_s

    async def one(p: Prompt) -> None:
        rec = await send_request(session, url, p, model, workload, t0, headers)
        records.append(rec)
        bar.update(rec.success)

    if step.concurrency is not None and step.rate is None and step.time_scale is None:
        queue = iter(prompts)

        async def worker() -> None:
            for p in queue:
                if deadline is not None and time.perf_counter() - t0 >= deadline:
                    return
                await one(p)

        await asyncio.gather(*(worker() for _ in range(step.concurrency)))
    else:
        if step.time_scale is not None:
            if workload.trace is None:
                raise DisaggError("a trace step needs a workload read from a trace")
            offsets = workload.trace.offsets(step.time_scale)[:len(prompts)]
        else:
            assert step.rate is not None
            burst = 1.0 if workload.arrival == "poisson" else workload.burstiness
            offsets = arrival_offsets(len(prompts), step.rate, burst, workload.seed)
        cap = asyncio.Semaphore(step.concurrency) if step.concurrency else None

        async def capped(p: Prompt) -> None:
            if cap is None:
                await one(p)
                return
            async with cap:
                await one(p)

        tasks = []
        for p, at in zip(prompts, offsets, strict=True):
            if deadline is not None and at >= deadline:
                break
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(capped(p)))
        await asyncio.gather(*tasks)
    duration = time.perf_counter() - t0
    bar.close()
    records.sort(key=lambda r: r.index)
    n_capped = None
    if workload.trace is not None and prompts and all(p.capped is not None for p in prompts):
        n_capped = sum(bool(p.capped) for p in prompts)
    return RunResult(step=step, started_at=started_at, duration_s=duration, records=records,
                     loadavg=(load_start, os.getloadavg()[0]),
                     metrics=metrics_by_class(records, duration, slo, percentiles),
                     exact_prompts=all(p.exact for p in prompts), capped=n_capped)


async def _warm_up(session: aiohttp.ClientSession, url: str, model: str, workload: Workload,
                   headers: dict[str, str] | None) -> None:
    """One small request; a failure here stops the bench with the server's answer."""
    probe = Prompt(index=-1, klass="warmup", text="[warm-up] Hello", input_len=4, output_len=4, exact=False)
    rec = await send_request(session, url, probe, model, workload, time.perf_counter(), headers)
    if not rec.success:
        raise DisaggError(f"warm-up request to {url} failed: {rec.error}")


def repeat_workload(workload: Workload, repeat: int) -> Workload:
    """The workload of repeat ``repeat`` (0-based) of a step: seed + repeat and, from the second
    repeat on, a salt of its own (its prompts' tags differ from every other repeat's)."""
    if repeat == 0:
        return workload
    return replace(workload, seed=workload.seed + repeat, salt=f"{workload.salt}r{repeat}.")


async def run_sweep(target: Target, workload: Workload, steps: Sequence[Step], slo: SLO = NO_SLO,
                    progress: bool = True, warmup: int = 1,
                    percentiles: Sequence[float] = DEFAULT_PERCENTILES, repeats: int = 1) -> BenchResult:
    """Resolve the model, warm up, then ``repeats`` runs per step (back to back), each with fresh
    prompts (:func:`repeat_workload`; each step its own tags), the target's route counters scraped
    before and after each run."""
    if repeats < 1:
        raise DisaggError(f"repeats must be at least 1, got {repeats}")
    base = normalize_base_url(target.base_url)
    headers = dict(target.headers) or None
    path = CHAT_PATH if workload.api == "chat" else COMPLETIONS_PATH
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:
        model = target.model or await resolve_model(session, base)
        for _ in range(warmup):
            await _warm_up(session, base + path, model, workload, headers)
        tok_urls = () if target.tokenize_urls is None else (target.tokenize_urls or (base,))
        runs = []
        for round_index, step in enumerate(steps):
            for k in range(repeats):
                wl = repeat_workload(workload, k)
                prompts = await build_prompts(session, tok_urls, model, wl, class_sequence(wl),
                                              chars_per_token=target.chars_per_token, round_index=round_index)
                before = await scrape(session, base)
                run = await run_step(session, base + path, model, prompts, wl, step, slo, headers, progress,
                                     percentiles, title=f"{step.label} #{k + 1}" if repeats > 1 else None)
                run.repeat = k
                run.routes = route_delta(before, await scrape(session, base))
                runs.append(run)
    return BenchResult(base_url=base, model=model, workload=workload, slo=slo, runs=runs, repeats=repeats)
