"""Prefill side of streamed transfers: which blocks of which layers are ready to send.

A streamed request (``kv_transfer_params.stream_key`` on a prefill engine)
sends its KV while it is being computed. The decode engine connects to the
listener with the same key as soon as its own blocks are allocated
(server.py, op ``stream``); the listener sends each layer's blocks as the
forward pass writes them. Who tells this table what:

- the engine thread, before each forward (``SocketWorker.bind_step``, from
  the step's metadata): streams opened, their block lists, the prompt tokens
  the step completes, streams that end now (the request was aborted or
  preempted: its blocks may be reused by this very forward, so
  :meth:`StreamTable.close` cuts the connection reading them and waits until
  no listener thread does);
- the engine thread, during the forward: :meth:`StreamTable.mark_layer` after
  each attention layer wrote its KV (``save_kv_layer``), :meth:`mark_step`
  at its end (``wait_for_save``: everything of the step is written, whether
  or not a layer's hook ran). Tokens the request had before the step (earlier
  chunks, prefix-cache hits) count as written only then too: a hit may be on
  blocks another request writes in this same forward;
- the engine thread, when the request finished (its lease is registered):
  :meth:`StreamTable.finished`; from then on the lease holds the blocks;
- listener threads: :meth:`attach`, :meth:`wait_progress`, :meth:`reading`
  and :meth:`detach`; :meth:`abandon` when a decode engine says it will
  never read a key (op ``abandon``: its request ended before it was
  scheduled, so it received nothing). A reader that gave up waiting
  for the request to be scheduled here (``attach``'s wait ran out) abandons
  its key the same way. An abandoned stream holds no lease: its request's
  blocks are freed when it finishes (or at once, if it already did), instead
  of waiting out the lease for a reader that never comes. Keys abandoned
  before their request was scheduled are remembered (at most
  :data:`ABANDONED_MAX`, for :data:`ABANDONED_TTL_S`).

Blocks are read from the cache in place (no staging on this side); a block's
bytes are only read while :meth:`reading` holds the stream open, and the
table never lets a stream be read after the engine may have reused its blocks.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from .metadata import StreamStep

#: keys abandoned before their request was scheduled here, remembered at most this many ...
ABANDONED_MAX = 4096
#: ... and for this long (a prefill engine's queue may hold a request this long)
ABANDONED_TTL_S = 600.0


class StreamClosed(ConnectionError):
    """The stream ended before everything was sent; the message says why."""


@dataclass
class Stream:
    """One streamed request's progress on this prefill engine."""

    key: str
    request_id: str
    num_tokens: int
    block_ids: list[int]
    #: prompt tokens whose KV is in the cache, per layer (wire order)
    ready: list[int]
    #: per layer: when it last became more ready (a counter): the listener sends in that order
    ready_seq: list[int]
    #: per layer: an accelerator event to wait on before reading (None on host caches)
    events: list[Any]
    #: per layer: when it last became more ready (the clock's time; for the listener's log)
    ready_at: list[float]
    closed: str | None = None
    readers: int = 0
    attached: bool = False
    #: the decode connection reading it (close() cuts it, so that a slow reader cannot hold the engine)
    conn: socket.socket | None = None
    #: everything was sent, or the reader left: this side need not hold the blocks for it
    done: bool = False
    #: the request finished and its lease is registered (the lease then holds the blocks)
    leased: bool = False
    opened_at: float = field(default_factory=time.monotonic)
    #: when every layer of the whole prompt was written (None: not yet)
    computed_at: float | None = None

    def blocks_ready(self, layer: int, block_size: int) -> int:
        """Leading blocks of the request whose every token is written at ``layer``."""
        tokens = self.ready[layer]
        full = -(-self.num_tokens // block_size) if tokens >= self.num_tokens else tokens // block_size
        return min(full, len(self.block_ids))


class StreamTable:
    """Thread-safe table of the streams a prefill worker serves (see the module docstring)."""

    def __init__(self, block_size: int, num_layers: int, clock: Callable[[], float] = time.monotonic):
        self.block_size = block_size
        self.num_layers = num_layers
        self._clock = clock
        self._cond = threading.Condition()
        self._streams: dict[str, Stream] = {}
        self._by_request: dict[str, str] = {}
        self._step: dict[str, int] = {}     # key -> tokens ready after this step's forward
        self._seq = 0
        self._abandoned: OrderedDict[str, float] = OrderedDict()   # key -> when (before it was scheduled)

    # -- engine thread --------------------------------------------------------
    def bind_step(self, steps: Mapping[str, StreamStep], closes: Mapping[str, str]) -> list[str]:
        """Apply a step's metadata before its forward; returns the keys refused (a key already
        streaming another request: that request's KV is not streamed)."""
        for key, reason in closes.items():
            self.close(key, reason)
        refused: list[str] = []
        with self._cond:
            self._step = {}
            for key, step in steps.items():
                stream = self._streams.get(key)
                if stream is None:
                    stream = Stream(key, step.request_id, step.num_tokens, [], [0] * self.num_layers,
                                    [0] * self.num_layers, [None] * self.num_layers, [0.0] * self.num_layers)
                    # abandoned before it was scheduled: nobody will read it, its lease ends at once
                    stream.done = self._abandoned.pop(key, None) is not None
                    self._streams[key] = stream
                    self._by_request[step.request_id] = key
                elif stream.request_id != step.request_id:
                    refused.append(key)
                    continue
                # Tokens before the step (earlier chunks, prefix-cache hits) count as written only
                # with this step's marks: a hit may be on blocks that another request writes in
                # this very forward (vLLM caches a block's hash when it schedules it), or on an
                # accelerator stream not done yet.
                stream.block_ids = list(step.block_ids)
                self._step[key] = min(step.ready_after, stream.num_tokens)
            self._cond.notify_all()
        return refused

    def _advance(self, stream: Stream, layers: range | list[int], tokens: int, event: Any) -> None:
        self._seq += 1
        for layer in layers:
            if tokens > stream.ready[layer]:
                stream.ready[layer] = tokens
                stream.ready_seq[layer] = self._seq
                stream.events[layer] = event
                stream.ready_at[layer] = self._clock()
        if stream.computed_at is None and min(stream.ready) >= stream.num_tokens:
            stream.computed_at = self._clock()

    def mark_layer(self, layer: int, event: Any = None) -> None:
        """This step's forward wrote ``layer``'s KV (``event``: when an accelerator is done with it)."""
        with self._cond:
            if not self._step:
                return
            for key, tokens in self._step.items():
                stream = self._streams.get(key)
                if stream is not None:
                    self._advance(stream, [layer], tokens, event)
            self._cond.notify_all()

    def mark_step(self, event: Any = None) -> None:
        """This step's forward is over: every layer of its streams is written (``event``: when an
        accelerator is done with them)."""
        with self._cond:
            for key, tokens in self._step.items():
                stream = self._streams.get(key)
                if stream is not None:
                    self._advance(stream, range(self.num_layers), tokens, event)
            self._step = {}
            self._cond.notify_all()

    def finished(self, key: str, request_id: str) -> bool:
        """The request finished and its lease is registered; True when the stream already sent
        everything (or its reader left): the caller then releases the lease at once."""
        with self._cond:
            stream = self._streams.get(key)
            if stream is None or stream.request_id != request_id:
                return False
            stream.leased = True
            if stream.done:
                self._forget(stream)
            return stream.done

    def streaming(self, request_id: str) -> bool:
        """Whether a stream still holds ``request_id``'s lease (a peer's ``release`` must not end it)."""
        with self._cond:
            return request_id in self._by_request

    def key_of(self, request_id: str) -> str | None:
        with self._cond:
            return self._by_request.get(request_id)

    def close(self, key: str, reason: str) -> None:
        """End a stream (request aborted or preempted, lease expired): readers get StreamClosed.
        Returns once no listener thread reads its blocks any more."""
        with self._cond:
            stream = self._streams.get(key)
            if stream is None:
                return
            stream.closed = reason
            self._forget(stream)
            self._cond.notify_all()
            if stream.readers and stream.conn is not None:
                try:  # a send blocked on a slow reader returns at once (EPIPE) instead of at its timeout
                    stream.conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            while stream.readers:
                self._cond.wait()

    def _forget(self, stream: Stream) -> None:
        if self._streams.get(stream.key) is stream:
            del self._streams[stream.key]
        if self._by_request.get(stream.request_id) == stream.key:
            del self._by_request[stream.request_id]
        self._step.pop(stream.key, None)

    @property
    def stepping(self) -> bool:
        """Whether the step being run advances any stream (a read without the lock: a hint)."""
        return bool(self._step)

    def __len__(self) -> int:
        with self._cond:
            return len(self._streams)

    # -- listener threads ---------------------------------------------------------
    def attach(self, key: str, wait_s: float, num_tokens: int, first: int = 0, conn: socket.socket | None = None
               ) -> Stream | str:
        """The stream a decode engine asks for from block ``first`` on, waiting up to ``wait_s`` for
        the prefill engine to schedule its request, now read by ``conn``; or why not (never came,
        ended, read by another connection, counted ``num_tokens`` differently or asks past the
        prompt's blocks: then it stays free for the right reader)."""
        deadline = self._clock() + wait_s
        with self._cond:
            while True:
                stream = self._streams.get(key)
                if stream is not None:
                    if stream.attached or stream.done or stream.closed:
                        return "ended, or already being read"
                    if stream.num_tokens != num_tokens:
                        return (f"request {stream.request_id}: {num_tokens} prompt tokens there, "
                                f"{stream.num_tokens} here (different tokenization?)")
                    if first >= -(-num_tokens // self.block_size):
                        return f"request {stream.request_id}: first block {first} is past the prompt"
                    stream.attached, stream.conn = True, conn
                    return stream
                left = deadline - self._clock()
                if left <= 0:
                    self._remember_abandoned(key)  # the reader computes the prompt itself now
                    return f"not scheduled within {wait_s:g} s"
                self._cond.wait(left)

    def wait_progress(self, stream: Stream, sent: list[int], first: int, per_message: int,
                      timeout_s: float) -> list[tuple[int, int, int]]:
        """Messages ready to send: (layer, start, count) with ``start`` counted from block ``first``,
        layers in the order they became ready. Waits up to ``timeout_s`` for any (an empty list
        when none came); raises StreamClosed when the stream ends."""
        deadline = self._clock() + timeout_s
        with self._cond:
            while True:
                if stream.closed:
                    raise StreamClosed(stream.closed)
                out: list[tuple[int, int, int]] = []
                for layer in sorted(range(self.num_layers), key=lambda i: stream.ready_seq[i]):
                    avail = stream.blocks_ready(layer, self.block_size) - first
                    start = sent[layer]
                    while avail > start:
                        count = min(avail - start, per_message)
                        out.append((layer, start, count))
                        start += count
                if out:
                    return out
                left = deadline - self._clock()
                if left <= 0:
                    return out
                self._cond.wait(left)

    def abandon(self, key: str) -> str | None:
        """A decode engine will never read ``key`` (see the module docstring); returns the request id
        whose lease the caller must release now (its request already finished here), else None. A
        stream being read is left alone (the reader is another engine, or this one retrying)."""
        with self._cond:
            stream = self._streams.get(key)
            if stream is None:
                self._remember_abandoned(key)
                return None
            if stream.attached or stream.done or stream.closed:
                return None
            stream.done = True
            if stream.leased:
                self._forget(stream)
                return stream.request_id
            return None

    def _remember_abandoned(self, key: str) -> None:
        now = self._clock()
        self._abandoned[key] = now
        self._abandoned.move_to_end(key)
        while self._abandoned:
            oldest, when = next(iter(self._abandoned.items()))
            if len(self._abandoned) <= ABANDONED_MAX and now - when <= ABANDONED_TTL_S:
                break
            del self._abandoned[oldest]

    @contextmanager
    def reading(self, stream: Stream) -> Iterator[tuple[list[int], list[Any]]]:
        """Hold the stream open while its blocks are read: yields its block ids and per-layer
        events; raises StreamClosed if it ended."""
        with self._cond:
            if stream.closed:
                raise StreamClosed(stream.closed)
            stream.readers += 1
            ids, events = stream.block_ids, list(stream.events)
        try:
            yield ids, events
        finally:
            with self._cond:
                stream.readers -= 1
                self._cond.notify_all()

    def detach(self, stream: Stream) -> str | None:
        """The decode connection is done with the stream (all sent, or it failed); returns the
        request id whose lease the caller must release now (the request already finished)."""
        with self._cond:
            stream.attached, stream.conn = False, None
            stream.done = True
            if stream.leased and not stream.closed:
                self._forget(stream)
                return stream.request_id
            return None
