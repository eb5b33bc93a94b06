"""Prefill-side leases: which blocks a decode engine may fetch, and until when.

The engine's scheduler keeps a finished request's blocks alive (delay free)
and the worker registers them here with a time to live. A lease ends when the
decode side releases it after fetching, or when it expires because the decode
side never came; either way the worker reports the request as finished
sending and vLLM frees the blocks. A lease with a fetch in flight never
expires under it: the fetch's own I/O timeout bounds that.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass
class Lease:
    """One request's blocks held for a remote fetch."""

    request_id: str
    block_ids: tuple[int, ...]
    deadline: float
    active: int = 0
    released: bool = False
    fetched_bytes: int = 0
    allowed: frozenset[int] = field(init=False)

    def __post_init__(self) -> None:
        self.allowed = frozenset(self.block_ids)


class LeaseTable:
    """Thread-safe lease registry shared by the worker and the listener threads."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._cond = threading.Condition()
        self._leases: dict[str, Lease] = {}
        self._done: set[str] = set()
        self._expired: set[str] = set()

    def register(self, request_id: str, block_ids: Sequence[int], ttl_s: float) -> None:
        """Hold ``block_ids`` for ``request_id`` for ``ttl_s`` seconds."""
        with self._cond:
            self._leases[request_id] = Lease(request_id, tuple(block_ids), self._clock() + ttl_s)
            self._cond.notify_all()

    def acquire(self, request_id: str, wait_s: float) -> Lease | None:
        """Start a fetch on ``request_id``; waits up to ``wait_s`` for it to be registered.

        The wait covers the moment between the prefill engine answering the
        client and its worker learning about the lease (the next engine step).
        Returns None for an unknown, released or expired request.
        """
        deadline = self._clock() + wait_s
        with self._cond:
            while True:
                lease = self._leases.get(request_id)
                if lease is not None and not lease.released:
                    lease.active += 1
                    return lease
                remaining = deadline - self._clock()
                if lease is not None or remaining <= 0:
                    return None
                self._cond.wait(remaining)

    def end_fetch(self, lease: Lease, nbytes: int) -> None:
        """A fetch started with acquire() is over (done or failed)."""
        with self._cond:
            lease.active -= 1
            lease.fetched_bytes += nbytes
            self._cond.notify_all()

    def release(self, request_id: str) -> bool:
        """The decode side is done with ``request_id``; False if it was not leased."""
        with self._cond:
            lease = self._leases.get(request_id)
            if lease is None or lease.released:
                return False
            lease.released = True
            if lease.active == 0:
                del self._leases[request_id]
                self._done.add(request_id)
            self._cond.notify_all()
            return True

    def reap(self, wait_s: float = 0.0) -> tuple[set[str], set[str]]:
        """Collect finished leases: (released, expired) request ids, each reported once.

        With ``wait_s`` > 0 and leases outstanding but none finished, waits up
        to that long for one to be released or to expire.
        """
        deadline = self._clock() + wait_s
        with self._cond:
            while True:
                now = self._clock()
                next_expiry = self._collect(now)  # > now: anything due is collected
                remaining = deadline - now
                if self._done or self._expired or not self._leases or remaining <= 0:
                    break
                self._cond.wait(min(remaining, next_expiry - now))
            done, expired = self._done, self._expired
            self._done, self._expired = set(), set()
            return done, expired

    def _collect(self, now: float) -> float:
        """Move ended leases to the done/expired sets; returns the next deadline (caller holds the lock)."""
        next_expiry = float("inf")
        for rid, lease in list(self._leases.items()):
            if lease.active:
                continue
            if lease.released:
                self._done.add(rid)
                del self._leases[rid]
            elif now >= lease.deadline:
                self._expired.add(rid)
                del self._leases[rid]
            else:
                next_expiry = min(next_expiry, lease.deadline)
        return next_expiry

    def __len__(self) -> int:
        with self._cond:
            return len(self._leases)
