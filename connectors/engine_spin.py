"""vLLM general plugin: an engine's queue readers stop busy-waiting soon after a message, on few cores.

vLLM's engine core hands each step to its worker process, and takes the worker's answer back,
through shared-memory queues (``vllm/distributed/device_communicators/shm_broadcast.py``). A
reader of such a queue (``SpinCondition.wait``) busy-waits, calling ``sched_yield`` in a loop,
for ``busy_loop_s`` (1 s) after each message, and only then sleeps on a socket that the writer
notifies on every message. On a GPU host that spin costs a spare CPU core and saves a wake-up per
step. On a CPU engine pinned to one core, as ``disagg up`` starts them, it takes that core for a
second after every burst of work, from the next request and from the KV connector's threads.
Measured on the emulated house (tiny-kvheavy, socket connector, one core per engine, side by
side): the decode engine used 1.0 s of CPU in the 2 s after a split (0.02-0.04 s idle), and
256-token splits of 256 output tokens sent 0.2 s apart answered in 131-142 ms (p50) against
101-104 ms with this plugin (docs/engines.md).

Cutting ``busy_loop_s`` itself short is not enough: a reader that sleeps on the socket soon
after a message misses wake-ups and then sleeps until vLLM's 5 s recheck. The writer's socket
has a high-water mark of one message and drops a notification sent before the reader's taking
of the last one has reached it: with notifications 0.2-1 ms apart, each taken as it came, 26-49%
never arrived (none 2 ms apart; a real ``SpinCondition`` pair, this 2-core machine). With the spin
capped at 2 ms, requests at 1 req/s on the default topology had a TTFT p99 of 4.7 s (0.16 s with
vLLM's spin). So this plugin keeps vLLM's two phases and changes the middle of the first:
for ``DISAGG_ENGINE_SPIN_S`` seconds after a message the reader spins as vLLM's does; then,
until :data:`SOCKET_AFTER_S` after it, it sleeps a twentieth of the time since the message and
looks again (a notification may be dropped so soon after the last one: the sleep bounds the
delay to 5% of the gap between messages, at a few percent of a core); from then until vLLM's
``busy_loop_s`` it waits on the socket at most :data:`POLL_MS` at a time, taking each
notification as it comes, so a message wakes it at once and a dropped notification costs at most
that poll; past ``busy_loop_s`` it sleeps on the socket as vLLM's does.

``disagg up`` does not set it: an instance's ``env`` does (``topologies/house-emulated.yaml``
gives both boxes :data:`CPU_SPIN_S`; ``1`` or more is vLLM's own): on the default topology at 4
req/s its decode engine answered local prefills later and TPOT rose, not explained yet
(docs/engines.md), so it stays off unless an instance asks. Who calls what: vLLM
calls :func:`register` in each process it starts (entry point ``vllm.general_plugins``); it
wraps ``SpinCondition.wait``, which every queue reader calls while it has nothing to read.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from collections.abc import Callable
from typing import Any

ENV = "DISAGG_ENGINE_SPIN_S"
#: the busy-wait the emulated house's engines ask for (seconds)
CPU_SPIN_S = "0.002"
#: until this long after its last message a reader past its spin sleeps SLEEP_SHARE of the time
#: since that message (at least SLEEP_MIN_S) and looks again: the writer's socket may drop the
#: next notification so soon after the last
SOCKET_AFTER_S = 0.02
SLEEP_SHARE = 0.05
SLEEP_MIN_S = 0.0001
#: from SOCKET_AFTER_S until vLLM's own ``busy_loop_s`` has passed since its last message, the
#: longest a reader sleeps on the socket before it looks at the queue again (milliseconds)
POLL_MS = 1


def parse_spin(text: str) -> float:
    """The env value as seconds; ValueError unless it is a finite number >= 0."""
    spin = float(text)
    if not math.isfinite(spin) or spin < 0:
        raise ValueError(f"{ENV}={text!r}: expected seconds >= 0")
    return spin


def polling(wait: Callable[..., Any], spin_s: float, recv_flags: int) -> Callable[..., Any]:
    """``wait`` (``SpinCondition.wait``) with its busy-wait cut to ``spin_s`` seconds after the
    reader's last message, short sleeps until :data:`SOCKET_AFTER_S`, and short waits on its
    socket for the rest of vLLM's ``busy_loop_s`` (module doc); writers, and readers inside their
    spin or past ``busy_loop_s``, get vLLM's own. ``recv_flags``: zmq's NOBLOCK, to take a
    notification without waiting."""

    @functools.wraps(wait)
    def wait_polling_past_spin(self: Any, timeout_ms: int | None = None) -> Any:
        if not getattr(self, "is_reader", False):
            return wait(self, timeout_ms)
        since = time.monotonic() - self.last_read
        if since <= spin_s or since > self.busy_loop_s:
            return wait(self, timeout_ms)
        if since < SOCKET_AFTER_S:     # the next message's notification may be dropped: look again soon
            time.sleep(max(SLEEP_MIN_S, SLEEP_SHARE * since))
            return None
        events = dict(self.poller.poll(timeout=POLL_MS if timeout_ms is None else min(POLL_MS, timeout_ms)))
        if self.local_notify_socket in events:   # conflated: one notification stands for every one since
            self.local_notify_socket.recv(flags=recv_flags, copy=False)
        return None

    return wait_polling_past_spin


def register() -> None:
    """vLLM calls this in every process it starts; active only where ``DISAGG_ENGINE_SPIN_S`` is set."""
    text = os.environ.get(ENV)
    if not text:
        return
    spin_s = parse_spin(text)
    try:
        import zmq
        from vllm.distributed.device_communicators import shm_broadcast
    except ImportError:  # a vLLM without the shared-memory queue
        return
    cond = getattr(shm_broadcast, "SpinCondition", None)
    if cond is None or hasattr(cond.wait, "__wrapped__"):  # another vLLM, or registered already
        return
    cond.wait = polling(cond.wait, spin_s, zmq.NOBLOCK)
    logging.getLogger("vllm").info("disagg: engine queue readers busy-wait %g s after a message, then sleep "
                                   "briefly or poll their socket until vLLM's own spin would end (%s)", spin_s, ENV)
