"""vLLM general plugin: shorten the engine worker's busy-wait on an engine of few cores.

vLLM's engine core hands each step to its worker process through a shared-memory queue
(``vllm/distributed/device_communicators/shm_broadcast.py``). A reader of that queue
(``SpinCondition.wait``) busy-waits, calling ``sched_yield`` in a loop, for ``busy_loop_s``
(1 s) after each message before it sleeps on a socket: on a GPU host that spin costs a
spare CPU core and saves a wake-up per step. On a CPU engine pinned to one core, as
``disagg up`` starts them, the spin takes that core for a second after every burst of
work. Measured on the emulated house (tiny-kvheavy, socket connector, one core per
engine): each engine's worker used 1.0 s of CPU in the 3 s after a split it served
(0.04 s idle), and 256-token splits sent 0.2 s apart answered in 175-180 ms (p50;
125-666 ms) against 102-109 ms (95-125 ms) with the spin cut to 2 ms, the worker then
as idle as before. The next request's work and the KV connector's threads shared the
core with the spin.

This plugin caps ``busy_loop_s`` at ``DISAGG_ENGINE_SPIN_S`` seconds (``disagg up`` sets
:data:`CPU_SPIN_S` for every vLLM engine on a ``device: cpu`` host; an instance's
``env`` may set another value, or ``1`` for vLLM's own). A reader past the cap waits on
the queue's socket, which its writer notifies on every message: a step then starts a
wake-up later (tens of microseconds) instead of at once. Who calls what: vLLM calls
:func:`register` in each process it starts (entry point ``vllm.general_plugins``); it
wraps ``SpinCondition.wait``, which every queue reader calls before it reads.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Callable
from typing import Any

ENV = "DISAGG_ENGINE_SPIN_S"
#: the busy-wait ``disagg up`` gives CPU engines (seconds)
CPU_SPIN_S = "0.002"


def parse_spin(text: str) -> float:
    """The env value as seconds; ValueError unless it is a finite number >= 0."""
    spin = float(text)
    if not math.isfinite(spin) or spin < 0:
        raise ValueError(f"{ENV}={text!r}: expected seconds >= 0")
    return spin


def capped(wait: Callable[..., Any], spin_s: float) -> Callable[..., Any]:
    """``wait`` (``SpinCondition.wait``) with the reader's ``busy_loop_s`` at most ``spin_s``."""

    @functools.wraps(wait)
    def wait_with_capped_spin(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "busy_loop_s", 0) > spin_s:
            self.busy_loop_s = spin_s
        return wait(self, *args, **kwargs)

    return wait_with_capped_spin


def register() -> None:
    """vLLM calls this in every process it starts; active only where ``DISAGG_ENGINE_SPIN_S`` is set."""
    text = os.environ.get(ENV)
    if not text:
        return
    spin_s = parse_spin(text)
    try:
        from vllm.distributed.device_communicators import shm_broadcast
    except ImportError:  # a vLLM without the shared-memory queue
        return
    cond = getattr(shm_broadcast, "SpinCondition", None)
    if cond is None or hasattr(cond.wait, "__wrapped__"):  # another vLLM, or registered already
        return
    cond.wait = capped(cond.wait, spin_s)
    logging.getLogger("vllm").info("disagg: engine queue readers busy-wait at most %g s (%s)", spin_s, ENV)
