"""What each engine's KV cache holds for the routes the proxy sent it, and when that comes free.

An engine whose KV cache is full admits no new prompt until running requests end (vLLM
schedules a waiting prompt only once its blocks fit). On a host with little memory that
wait, not the prefill queue, is most of a prompt's time to first token under load: an
emulated gaming PC with 6,144 tokens of KV serving 2,048-token prompts with 256-token
answers had its whole and split prompts predicted 56-67% too early at 1-1.5 requests/s
when the wait was not priced. The router (:class:`disagg.proxy.router.Router`) books each
route it decides here as it goes out:

- the engine that decodes it holds the prompt and its expected output (the size the request
  grows to: vLLM preempts the newest request when running ones outgrow the cache, so that
  room is taken) from then until the request is expected to end: its predicted first token
  plus its expected output tokens at that engine's time per output token, re-estimated at
  the first token;
- a split's prefill engine holds the prompt until the decode engine has the KV (its first
  token);
- everything a route holds is released when the route is over (:meth:`KvLedger.release`).

:meth:`KvLedger.room` turns the book and an engine's capacity into the free tokens and the
expected frees that :func:`disagg.routecost.kv_wait_s` prices. The capacity is the engine's
own (``vllm:cache_config_info``: blocks x block size, read by the health prober when an
engine comes into service: ``Backend.kv_capacity_tokens``); where it is not known nothing
waits for KV. Routes the policy does not decide (those that must stay where they are) are
not booked: the book is a lower bound of what the cache holds.

Pure state; the clock is passed in (perf_counter seconds), so tests drive it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(eq=False, slots=True)   # identity: two holds of one size on one engine are two entries
class KvHold:
    """KV held on the engine at ``url`` for one route: ``tokens``, expected free at ``until``
    (perf_counter; :meth:`KvLedger.retime` moves it)."""

    url: str
    tokens: float
    until: float = math.inf


class KvLedger:
    """The KV each engine holds for the routes in flight (module doc)."""

    __slots__ = ("_holds",)

    def __init__(self) -> None:
        self._holds: dict[str, list[KvHold]] = {}

    def hold(self, url: str, tokens: float, until: float) -> KvHold:
        """Book ``tokens`` of KV on the engine at ``url`` until ``until``; the handle goes back to
        :meth:`release` when the route is over."""
        handle = KvHold(url, max(tokens, 0.0), until)
        self._holds.setdefault(url, []).append(handle)
        return handle

    @staticmethod
    def retime(handle: KvHold, until: float) -> None:
        """The hold is now expected to end at ``until`` (the request's first token came)."""
        handle.until = until

    def release(self, handle: KvHold) -> None:
        """The hold is over (the route ended, or its KV left the engine). Nothing when it was
        released already, or the engine forgotten meanwhile."""
        holds = self._holds.get(handle.url)
        if holds is None or not any(h is handle for h in holds):
            return
        holds[:] = [h for h in holds if h is not handle]
        if not holds:
            del self._holds[handle.url]

    def held_tokens(self, url: str) -> float:
        """KV tokens booked on the engine at ``url`` now."""
        return sum(h.tokens for h in self._holds.get(url, ()))

    def room(self, url: str, capacity_tokens: float | None,
             now: float) -> tuple[float, tuple[tuple[float, float], ...]]:
        """``(free tokens, expected frees)`` of the engine at ``url`` at ``now``, for
        :class:`~disagg.routecost.EngineCost`'s ``kv_free_tokens`` and ``kv_frees``: its capacity
        less what is booked, and each hold's (seconds until it is expected to end, tokens),
        soonest first; a hold past its expected end counts as ending now. ``(inf, ())`` when the
        capacity is not known. (Once per engine and decision: one pass over the holds.)"""
        if capacity_tokens is None:
            return math.inf, ()
        holds = self._holds.get(url)
        if not holds:
            return capacity_tokens, ()
        frees = sorted([(h.until - now if h.until > now else 0.0, h.tokens) for h in holds])
        return capacity_tokens - sum([tokens for _, tokens in frees]), tuple(frees)

    def forget(self, url: str) -> None:
        """The engine came back (a new process): what was booked there went with the old one."""
        self._holds.pop(url, None)
