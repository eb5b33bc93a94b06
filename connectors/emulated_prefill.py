"""vLLM general plugin: emulate a host that prefills at a given rate.

The project's thesis is about unlike hardware: a compute-rich box prefilling for
a box with little compute and ample memory. On one machine of CPU engines the
asymmetry that matters (slow prefill, decode as usual) cannot come from a CPU
share: a quota slows the API server, the engine core and the worker alike, and
CPU decode is mostly per-step overhead, so decode suffers more than prefill.
This plugin slows prefill alone, the way netem delays packets for a link: an
engine step that computes prompt tokens is held until those tokens would have
taken ``tokens / rate`` seconds at the host's rate; steps that only decode are
left alone. A step that mixes both (chunked prefill) is held for its prompt
tokens, as a slow accelerator would be. When the machine is already slower than
the rate, nothing is held: the emulation only ever slows an engine down.

Prompt tokens of a step: the tokens of every request scheduled more than one
token in it (prompt chunks, and recomputation after a preemption); a request
scheduled one token is decoding (vLLM's CPU engines run no speculative
decoding). The one token a decode engine recomputes after a KV handoff counts
as decode, which it nearly is.

Who calls what: vLLM calls :func:`register` in each process it starts
(entry point ``vllm.general_plugins``); it acts only where the environment has
``DISAGG_EMULATED_PREFILL_RATE`` (tokens/s, set by ``disagg up`` from a host's
``emulate: {prefill_rate: ...}``) and vLLM's scheduler is importable. It wraps
the v1 ``Scheduler.schedule`` (which stamps each step's start and prompt tokens)
and ``Scheduler.update_from_output`` (which the engine core calls once the
step's model output is ready, and which first waits out the rest of the step's
emulated time). The scheduler runs in the engine core process, so the API
server keeps answering ``/health`` and ``/metrics`` while a step is held.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

ENV = "DISAGG_EMULATED_PREFILL_RATE"


def parse_rate(text: str) -> float:
    """The env value as tokens/s; ValueError unless it is a finite positive number."""
    rate = float(text)
    if not math.isfinite(rate) or rate <= 0:
        raise ValueError(f"{ENV}={text!r}: expected a positive number of prompt tokens per second")
    return rate


def prompt_tokens(num_scheduled_tokens: Mapping[str, int]) -> int:
    """The prompt tokens a step computes: those of requests scheduled more than one token."""
    return sum(n for n in num_scheduled_tokens.values() if n > 1)


class StepHold:
    """The steps in flight and how long each must last at ``rate`` prompt tokens/s.

    :meth:`started` is called when the scheduler hands out a step, :meth:`hold` when its
    output comes back; ``clock`` and ``sleep`` are parameters so tests need not wait.
    """

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.rate = rate
        self._clock = clock
        self._sleep = sleep
        self._due: dict[int, float] = {}
        self._lock = threading.Lock()
        self.held_s = 0.0               # total time held so far (the log line at exit says it)
        self.tokens = 0                 # prompt tokens seen so far

    def started(self, step: object, num_scheduled_tokens: Mapping[str, int]) -> None:
        tokens = prompt_tokens(num_scheduled_tokens)
        if tokens == 0:
            return
        with self._lock:
            self._due[id(step)] = self._clock() + tokens / self.rate
            self.tokens += tokens

    def hold(self, step: object) -> float:
        """Wait until ``step`` has lasted its emulated time; returns the seconds waited."""
        with self._lock:
            due = self._due.pop(id(step), None)
        if due is None:
            return 0.0
        wait = due - self._clock()
        if wait <= 0:
            return 0.0
        self._sleep(wait)
        self.held_s += wait
        return wait


def wrap_scheduler(scheduler_cls: Any, hold: StepHold) -> None:
    """Wrap ``scheduler_cls.schedule`` and ``update_from_output`` with ``hold`` (once per class)."""
    schedule = scheduler_cls.schedule
    update = scheduler_cls.update_from_output
    if hasattr(schedule, "__wrapped__"):  # registered already in this process
        return

    @functools.wraps(schedule)
    def schedule_stamped(self: Any, *args: Any, **kwargs: Any) -> Any:
        output = schedule(self, *args, **kwargs)
        hold.started(output, output.num_scheduled_tokens)
        return output

    @functools.wraps(update)
    def update_after_hold(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        hold.hold(scheduler_output)
        return update(self, scheduler_output, *args, **kwargs)

    scheduler_cls.schedule = schedule_stamped
    scheduler_cls.update_from_output = update_after_hold


def register() -> None:
    """vLLM calls this in every process it starts; active only with ``DISAGG_EMULATED_PREFILL_RATE`` set.

    A value that is not a positive number stops the process (SystemExit, which vLLM's plugin
    loader does not swallow): an engine that silently ran at full speed would mislead every figure.
    """
    text = os.environ.get(ENV)
    if not text:
        return
    try:
        rate = parse_rate(text)
    except ValueError as exc:
        raise SystemExit(f"disagg: {exc}") from None
    try:
        from vllm.v1.core.sched.scheduler import Scheduler
    except ImportError:  # not a vLLM with the v1 scheduler (e.g. only the API server's deps)
        return
    if hasattr(Scheduler.schedule, "__wrapped__"):
        return
    wrap_scheduler(Scheduler, StepHold(rate))
    logging.getLogger("vllm").info("disagg: emulated prefill rate %s prompt tokens/s (%s): each step "
                                   "computing prompt tokens is held to that rate", f"{rate:,.0f}", ENV)
