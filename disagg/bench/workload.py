"""The workload: prompt classes, their mix, and when requests arrive.

A workload is fixed by its seed: the same seed gives the same sequence of
classes and the same arrival times, so two topologies (or two rates) see the
identical load. Arrival times follow ``vllm bench serve``'s ``get_request``:
gamma-distributed gaps with shape = burstiness and mean 1/rate (burstiness 1 is
a Poisson process), rescaled so the last arrival is at N/rate. A trace (:mod:`disagg.bench.trace`) instead
fixes every request's arrival and lengths (arrival ``trace``, one class ``trace``).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np

from disagg.bench.trace import Trace, cap_lengths

ARRIVALS = ("poisson", "gamma", "closed")
#: the arrival of a workload read from a trace (not an --arrival choice: --trace sets it)
TRACE_ARRIVAL = "trace"
#: the one prompt class of a trace workload
TRACE_CLASS = "trace"
DEFAULT_CLASSES = (("short", 128), ("medium", 512), ("long", 2048))
DEFAULT_OUTPUT_LEN = 64


@dataclass(frozen=True)
class PromptClass:
    """A named prompt length with its answer length, in tokens."""

    name: str
    input_len: int
    output_len: int
    weight: float = 1.0


@dataclass(frozen=True)
class Workload:
    """Everything that defines the load, independent of the endpoint and the rate."""

    classes: tuple[PromptClass, ...]
    num_requests: int = 100
    duration_s: float | None = None     # stop sending new requests after this long
    arrival: str = "poisson"            # poisson | gamma | closed
    burstiness: float = 1.0             # gamma shape (1 = Poisson); open loop only
    concurrency: int | None = None      # closed loop: in flight; open loop: optional cap
    seed: int = 0
    salt: str = ""                      # prefix of every prompt's tag: a new salt defeats the prefix cache
    api: str = "completions"            # completions | chat
    ignore_eos: bool = True
    temperature: float = 0.0
    timeout_s: float = 600.0            # one request, connect to last byte
    trace: Trace | None = None          # arrival "trace": each request's arrival and lengths

    def __post_init__(self) -> None:
        if not self.classes:
            raise ValueError("a workload needs at least one prompt class")
        names = [c.name for c in self.classes]
        if len(set(names)) != len(names) or "all" in names:
            raise ValueError(f"prompt class names must be unique and not 'all': {names}")
        for c in self.classes:
            if c.input_len < 1 or c.output_len < 1 or c.weight <= 0:
                raise ValueError(f"prompt class {c.name!r}: lengths must be >= 1 and weight > 0")
        if self.num_requests < 1:
            raise ValueError("the number of requests must be at least 1")
        if self.arrival not in (*ARRIVALS, TRACE_ARRIVAL):
            raise ValueError(f"arrival {self.arrival!r}: expected one of {', '.join(ARRIVALS)}")
        if (self.arrival == TRACE_ARRIVAL) != (self.trace is not None):
            raise ValueError("a trace workload has arrival 'trace', and only it")
        if self.trace is not None and self.num_requests != len(self.trace.requests):
            raise ValueError(f"a trace workload has one request per trace request ({len(self.trace.requests)})")
        if self.arrival == "closed" and not self.concurrency:
            raise ValueError("closed-loop arrivals need a concurrency (--concurrency N)")
        if self.burstiness <= 0:
            raise ValueError("burstiness must be positive")
        if self.api not in ("completions", "chat"):
            raise ValueError(f"api {self.api!r}: expected completions or chat")

    def klass(self, name: str) -> PromptClass:
        """The class called ``name``."""
        return next(c for c in self.classes if c.name == name)


def parse_classes(text: str | None, output_len: int = DEFAULT_OUTPUT_LEN) -> tuple[PromptClass, ...]:
    """``short=128,medium=512:32,long=2048:64@0.5`` -> classes.

    Each item is NAME=INPUT[:OUTPUT][@WEIGHT]; OUTPUT defaults to ``output_len``
    (comparable answer lengths across classes), WEIGHT to 1. None or empty gives
    the default short/medium/long classes. Raises ValueError naming the item.
    """
    if not text or not text.strip():
        return tuple(PromptClass(n, i, output_len) for n, i in DEFAULT_CLASSES)
    classes = []
    for item in text.split(","):
        name, sep, rest = item.strip().partition("=")
        try:
            if not sep or not name:
                raise ValueError
            rest, _, weight = rest.partition("@")
            inp, _, out = rest.partition(":")
            classes.append(PromptClass(name.strip(), int(inp), int(out) if out else output_len,
                                       float(weight) if weight else 1.0))
        except ValueError:
            raise ValueError(f"bad prompt class {item.strip()!r}: expected NAME=INPUT[:OUTPUT][@WEIGHT], "
                             "e.g. long=2048:64") from None
    return tuple(classes)


def trace_workload_classes(trace: Trace) -> tuple[PromptClass, ...]:
    """The one class of a trace workload: named ``trace``, with the trace's median prompt and
    answer lengths (what the prefill-rate probe and the report's class line use)."""
    inputs = sorted(r.input_len for r in trace.requests)
    outputs = sorted(r.output_len for r in trace.requests)
    return (PromptClass(TRACE_CLASS, inputs[len(inputs) // 2], outputs[len(outputs) // 2]),)


def class_sequence(workload: Workload) -> list[str]:
    """The class of each request, in order: counts proportional to the weights
    (largest remainder), shuffled with the workload's seed; a trace's requests are all ``trace``."""
    if workload.trace is not None:
        return [TRACE_CLASS] * len(workload.trace.requests)
    total = sum(c.weight for c in workload.classes)
    exact = [workload.num_requests * c.weight / total for c in workload.classes]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: (counts[i] - exact[i], i))
    for i in by_remainder[: workload.num_requests - sum(counts)]:
        counts[i] += 1
    seq = [c.name for c, n in zip(workload.classes, counts, strict=True) for _ in range(n)]
    random.Random(workload.seed).shuffle(seq)
    return seq


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times (s from the start) of ``n`` open-loop requests at ``rate`` req/s.

    ``rate`` = inf sends everything at once. Gaps are gamma(shape=burstiness,
    scale=1/(rate*burstiness)) drawn from ``numpy.random.RandomState(seed)``, then
    rescaled so the last send is at n/rate, as ``vllm bench serve`` does.
    """
    if rate <= 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    rng = np.random.RandomState(seed)
    if math.isinf(burstiness):
        gaps = [1.0 / rate] * n
    else:
        gaps = [float(g) for g in rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)]
    offsets = list(np.cumsum(gaps)) if gaps else []
    if offsets and offsets[-1] > 0:
        factor = (n / rate) / offsets[-1]
        offsets = [float(o) * factor for o in offsets]
    return offsets


#: prompt-length bucket bounds (tokens) for :func:`trace_length_classes`: a class per factor of 4
TRACE_BUCKETS = (256, 1024, 4096, 16384, 65536)


def trace_length_classes(trace: Trace, max_model_len: int | None = None) -> tuple[PromptClass, ...]:
    """A trace's requests as prompt classes by prompt length, for ``disagg plan --trace``: each
    request's lengths cut to ``max_model_len`` (:func:`disagg.bench.trace.cap_lengths`), then one
    class per bucket of :data:`TRACE_BUCKETS` (``<256``, ``256-1023``, ...) that holds any, with the
    bucket's median prompt and answer lengths and its share of the requests as its weight."""
    bounds = (0, *TRACE_BUCKETS, math.inf)
    buckets: dict[int, list[tuple[int, int]]] = {}
    for r in trace.requests:
        inp, out = (r.input_len, r.output_len) if max_model_len is None else cap_lengths(
            r.input_len, r.output_len, max_model_len)
        where = next(i for i in range(len(bounds) - 1) if inp < bounds[i + 1])
        buckets.setdefault(where, []).append((inp, out))
    classes = []
    for i in sorted(buckets):
        members = buckets[i]
        lo, hi = bounds[i], bounds[i + 1]
        name = f"<{hi:.0f}" if lo == 0 else f"{lo}+" if math.isinf(hi) else f"{lo}-{int(hi) - 1}"
        inputs = sorted(m[0] for m in members)
        outputs = sorted(m[1] for m in members)
        classes.append(PromptClass(name, inputs[len(inputs) // 2], outputs[len(outputs) // 2],
                                   len(members) / len(trace.requests)))
    return tuple(classes)


def trace_rate(trace: Trace, time_scale: float = 1.0) -> float:
    """A trace's mean arrival rate in requests per second at ``time_scale`` (2 = twice as fast):
    its requests after the first over the time from the first to the last. ValueError when every
    request arrives at once (no rate)."""
    span = trace.offsets(time_scale)[-1]
    if len(trace.requests) < 2 or span <= 0:
        raise ValueError(f"{trace.file}: every request arrives at the same time: the trace gives no rate")
    return (len(trace.requests) - 1) / span
