"""vLLM general plugin: emulate a host that prefills at a given rate.

The project's thesis is about unlike hardware: a compute-rich box prefilling for
a box with little compute and ample memory. On one machine of CPU engines the
asymmetry that matters (slow prefill, decode as usual) cannot come from a CPU
share: a quota slows the API server, the engine core and the worker alike, and
CPU decode is mostly per-step overhead, so decode suffers more than prefill.
This plugin slows prefill alone, the way netem delays packets for a link: an
engine step that computes prompt tokens lasts as long as those tokens would have
taken at the host's rate, ``tokens / rate`` seconds, or its own compute where
that is longer; steps that only decode are left alone. A step that mixes both
(chunked prefill) is held for its prompt tokens, as a slow accelerator would be.
When the machine is already slower than the rate, nothing is held: the emulation
only ever slows an engine down.

The step is held in two parts, so that its work, not only its end, happens no
sooner than on the emulated host: a KV connector that streams each layer's KV
during the forward (the socket connector's ``streaming``) must not hand the
decode engine a prompt's KV before the slow host could have. Before the forward
the step is held for the part of ``tokens / rate`` that its compute will not
cover: ``tokens / rate - MARGIN x estimate``, where the estimate is this
engine's compute for that many prompt tokens, learned from its own earlier steps
(:class:`ComputeEstimate`: a line fitted to the measured compute, from a step's
release to its output, against its prompt tokens). After the forward the step is
held for whatever remains of ``tokens / rate``, as when there is no estimate.
So a step lasts ``max(compute, tokens / rate)`` while its compute is within
``MARGIN`` (1.25) times the estimate, and, while the estimate does not overstate
the compute, its forward ends no sooner than ``tokens / rate / MARGIN`` (0.8 x)
after it was scheduled: a streamed prompt's last layer leaves at 0.8 to 1 x its
emulated prefill time. A compute more than ``MARGIN`` times the estimate makes
the step longer than ``tokens / rate`` by the excess, never shorter; an
estimate that overstates the compute (say, learned from short prompts, mostly
fixed cost, when a long one comes) only holds less before the forward. The engine's first step with prompt tokens has
no estimate: it is not held before the forward, only after (its KV may stream at
the machine's own speed); each later one is, the first chunk of a chunked
prompt teaching the estimate for the rest.

Prompt tokens of a step: the tokens of every request scheduled more than one
token in it (prompt chunks, and recomputation after a preemption); a request
scheduled one token is decoding (vLLM's CPU engines run no speculative
decoding). The one token a decode engine recomputes after a KV handoff counts
as decode, which it nearly is.

Who calls what: vLLM calls :func:`register` in each process it starts
(entry point ``vllm.general_plugins``); it acts only where the environment has
``DISAGG_EMULATED_PREFILL_RATE`` (tokens/s, set by ``disagg up`` from a host's
``emulate: {prefill_rate: ...}``) and vLLM's scheduler is importable. It wraps
the v1 ``Scheduler.schedule`` (which stamps each step's start and prompt tokens
and then holds it before its forward) and ``Scheduler.update_from_output``
(which measures the step's compute and first waits out the rest of its emulated
time). vLLM's engine core (``vllm/v1/engine/core.py``, ``EngineCore.step``)
calls ``schedule``, then the executor's ``execute_model`` (the forward, during
which a connector's ``save_kv_layer`` streams each layer), then
``update_from_output``, one step at a time: on CPU async scheduling is off and
there is no pipeline parallelism, so ``max_concurrent_batches`` is 1 and
``step``, not ``step_with_batch_queue``, runs. (With a batch queue a step's
measured compute would include its wait in the queue: the estimate could only
overstate the compute, and the step be held less before its forward.) The
scheduler runs in the engine core process, so the API server keeps answering
``/health`` and ``/metrics`` while a step is held.
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


class ComputeEstimate:
    """This engine's compute time for a step of ``n`` prompt tokens, learned from its own steps.

    A line ``a + b * n`` fitted by least squares to the steps measured so far, each older step
    weighing :attr:`DECAY` times the next one's, so the line follows the engine as its load changes.
    A line, not seconds per token: a short prompt's step is mostly fixed cost and would otherwise
    overstate a long one's. While the steps seen are all of about one size there is no slope to
    fit, and the estimate is their seconds per token times ``n``. :meth:`predict` is None until a
    step has been measured.
    """

    DECAY = 0.8

    def __init__(self) -> None:
        self._w = self._n = self._c = self._nn = self._nc = 0.0

    def add(self, tokens: int, compute_s: float) -> None:
        d, n, c = self.DECAY, float(tokens), max(compute_s, 0.0)
        self._w = self._w * d + 1.0
        self._n = self._n * d + n
        self._c = self._c * d + c
        self._nn = self._nn * d + n * n
        self._nc = self._nc * d + n * c

    def predict(self, tokens: int) -> float | None:
        if self._w == 0.0 or self._n <= 0.0:
            return None
        mean_n, mean_c = self._n / self._w, self._c / self._w
        var_n = self._nn / self._w - mean_n * mean_n
        if var_n > (0.1 * mean_n) ** 2:             # sizes spread enough to fit a slope
            slope = (self._nc / self._w - mean_n * mean_c) / var_n
            fixed = mean_c - slope * mean_n
            if slope > 0 and fixed >= 0:
                return fixed + slope * tokens
        return tokens * self._c / self._n           # seconds per token of the steps seen


class StepHold:
    """The steps in flight and how long each must last at ``rate`` prompt tokens/s.

    :meth:`started` is called when the scheduler hands out a step, before its forward: it holds the
    step for the part of its emulated time that this engine's compute, as :attr:`estimate` predicts
    it times :attr:`MARGIN`, will not cover. :meth:`hold` is called when the step's output comes
    back: it measures the compute (from the step's release to now) into the estimate and holds
    whatever remains of the emulated time. ``clock`` and ``sleep`` are parameters so tests need not
    wait.
    """

    MARGIN = 1.25   # the pre-hold leaves room for compute up to this times the estimate

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.rate = rate
        self._clock = clock
        self._sleep = sleep
        self._steps: dict[int, tuple[float, float, int]] = {}   # id(step) -> (due, released, tokens)
        self._lock = threading.Lock()
        self.estimate = ComputeEstimate()
        self.held_s = 0.0               # total time held so far, before and after the forward
        self.pre_held_s = 0.0           # of which before the forward
        self.tokens = 0                 # prompt tokens seen so far

    def started(self, step: object, num_scheduled_tokens: Mapping[str, int]) -> float:
        """Stamp ``step`` and hold it before its forward; returns the seconds held (0 with no prompt tokens).

        The first step, with no estimate yet, is not held here: :meth:`hold` then holds all of it.
        """
        tokens = prompt_tokens(num_scheduled_tokens)
        if tokens == 0:
            return 0.0
        start = self._clock()
        emulated = tokens / self.rate
        with self._lock:
            predicted = self.estimate.predict(tokens)
        pre = 0.0 if predicted is None else emulated - self.MARGIN * predicted
        if pre > 0:
            self._sleep(pre)
            self.held_s += pre
            self.pre_held_s += pre
        else:
            pre = 0.0
        with self._lock:
            self._steps[id(step)] = (start + emulated, self._clock(), tokens)
            self.tokens += tokens
        return pre

    def hold(self, step: object) -> float:
        """Learn ``step``'s compute, then wait until it has lasted its emulated time; returns the seconds waited."""
        now = self._clock()
        with self._lock:
            entry = self._steps.pop(id(step), None)
            if entry is None:
                return 0.0
            due, released, tokens = entry
            self.estimate.add(tokens, now - released)
        wait = due - now
        if wait <= 0:
            return 0.0
        self._sleep(wait)
        self.held_s += wait
        return wait


def wrap_scheduler(scheduler_cls: Any, hold: StepHold) -> None:
    """Wrap ``scheduler_cls.schedule`` and ``update_from_output`` with ``hold`` (once per class).

    ``schedule`` computes the step, then :meth:`StepHold.started` holds it before its forward;
    ``update_from_output`` first calls :meth:`StepHold.hold`.
    """
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
