"""Decode-side fetch: pull a request's blocks from the prefill engine's listener.

The block list is split into ``streams`` consecutive parts, each fetched on
its own authenticated connection in its own thread, straight into the
destination blocks. ``PeerConnections`` keeps those connections open between
fetches (the TCP and HMAC handshakes are paid once per connection, not per
request), and the lease is released after the fetch, off the request's
critical path, so the prefill engine frees its blocks at once.
"""

from __future__ import annotations

import logging
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from .auth import HANDSHAKE_TIMEOUT_S, client_handshake, listener_id
from .config import BLOCKS_PER_MESSAGE
from .layout import BlockStore
from .server import chunks
from .wire import (
    PeerClosed,
    WireError,
    recv_frame,
    recv_into_views,
    send_frame,
    set_io_timeout,
    wait_readable,
)

logger = logging.getLogger(__name__)

#: An idle pooled connection older than this is closed instead of reused
#: (the prefill side drops connections idle for twice as long).
MAX_IDLE_S = 60.0
#: pauses before dialling again when the listener closes a new connection before its greeting
#: (``connect``), each times 0.5-1.5 (0.22-0.66 s in all), so a burst of this engine's own connections over the
#: listener's per-address budget waits for the slots instead of failing
GREETING_RETRY_S = (0.01, 0.03, 0.1, 0.3)


class FetchError(ConnectionError):
    """A fetch failed; the message names the peer and the request.

    ``reached_peer`` says whether a connection was authenticated: only then
    is a later ``release_only`` worth trying.
    """

    reached_peer: bool = False


@dataclass(frozen=True)
class FetchPlan:
    """What to fetch and where to put it."""

    host: str
    port: int
    request_id: str
    remote_block_ids: Sequence[int]
    local_block_ids: Sequence[int]
    #: the prefill engine's id from kv_transfer_params; checked when given
    engine_id: str | None = None
    #: streamed transfer: the key, and the prompt length both sides must agree on
    stream_key: str | None = None
    num_tokens: int = 0
    #: streamed transfer: index among P's blocks of the first one wanted (the decode side's own
    #: prefix-cache hit covers those before it)
    first_block: int = 0


@dataclass(frozen=True)
class FetchOptions:
    """Transport knobs (from kv_connector_extra_config)."""

    streams: int = 2
    blocks_per_message: int = BLOCKS_PER_MESSAGE
    connect_timeout_s: float = 5.0
    io_timeout_s: float = 30.0
    #: the whole authentication exchange, whatever io_timeout_s says
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S


@dataclass(frozen=True)
class FetchResult:
    """A finished fetch."""

    nbytes: int
    seconds: float
    streams: int
    #: until the last stream had the prefill side's answer (connection, lease lookup); the rest is data
    answered_s: float = 0.0


def connect(host: str, port: int, secret: bytes, store: BlockStore, opts: FetchOptions,
            engine_id: str | None = None) -> tuple[socket.socket, str]:
    """Open, authenticate, identity- and layout-check one connection; raises FetchError.

    Returns the socket and the engine id the prefill side announced. A connection the listener
    closes before its greeting (its pre-authentication budget for this address was full: a burst
    of this engine's own connections, or strangers) is dialled again after each pause of
    :data:`GREETING_RETRY_S` (with jitter), then given up.
    """
    where = f"{host}:{port}"
    for pause in (*GREETING_RETRY_S, None):
        try:
            sock = socket.create_connection((host, port), timeout=opts.connect_timeout_s)
        except OSError as exc:
            raise FetchError(f"cannot connect to prefill KV listener {where}: {exc}") from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # Bound to the address dialled: a listener elsewhere relaying the real one's challenge gets nothing.
            client_handshake(sock, secret, listener_id(host, port), min(opts.handshake_timeout_s, opts.io_timeout_s))
            break
        except PeerClosed as exc:  # nothing received: closed at accept
            sock.close()
            if pause is None:
                raise FetchError(f"handshake with {where} failed: {exc} before its greeting, "
                                 f"{len(GREETING_RETRY_S) + 1} times (its pre-authentication budget is full)") from exc
            time.sleep(pause * (0.5 + random.random()))
        except (WireError, OSError) as exc:
            sock.close()
            raise FetchError(f"handshake with {where} failed: {exc}") from exc
    try:
        set_io_timeout(sock, opts.io_timeout_s)
        hello = recv_frame(sock)
        theirs = hello.get("layout")
        ours = store.layout.fingerprint()
        if theirs != ours:
            raise FetchError(f"KV layout of {where} differs from ours: {theirs} != {ours}"
                             + _wire_hint(theirs, store.layout.wire))
        announced = str(hello.get("engine_id"))
        if engine_id is not None and announced != engine_id:
            raise FetchError(f"{where} is engine {announced!r}, not {engine_id!r} (restarted?)")
        return sock, announced
    except (WireError, OSError) as exc:
        sock.close()
        raise FetchError(f"handshake with {where} failed: {exc}") from exc
    except FetchError:
        sock.close()
        raise


def _wire_hint(theirs: object, ours: str) -> str:
    """A hint when the two layouts differ in their wire format (the fingerprint's last entry)."""
    last = theirs[-1] if isinstance(theirs, list) and theirs else None
    their_wire = last[1] if isinstance(last, list) and len(last) == 2 and last[0] == "wire" else "raw"
    if their_wire == ours:
        return ""
    return (f" (wire format {their_wire!r} there, {ours!r} here: set the same "
            "kv_connector_extra_config.wire_format on both engines)")


@dataclass
class _Conn:
    sock: socket.socket
    engine_id: str
    reused: bool = False
    idle_since: float = field(default_factory=time.monotonic)


@contextmanager
def _closing_on_error(conn: _Conn, what: str) -> Iterator[None]:
    """An exchange on ``conn``: any error closes it, and leaves as a FetchError (``reached_peer``: the
    connection was authenticated) naming ``what``."""
    try:
        yield
    except FetchError as exc:  # a subclass of OSError: before the clause below
        conn.sock.close()
        exc.reached_peer = True
        raise
    except (WireError, OSError) as exc:
        conn.sock.close()
        err = FetchError(f"{what} failed: {exc}")
        err.reached_peer = True
        raise err from exc
    except BaseException:
        conn.sock.close()
        raise


class PeerConnections:
    """Authenticated connections to prefill listeners, kept open between fetches.

    Thread-safe: parallel streams and parallel fetches each check out their
    own connection. A connection goes back to the pool only after a complete
    exchange; any error closes it. A pooled connection the prefill side has
    closed meanwhile (restart, idle timeout) is noticed before use, or, if it
    breaks before the fetch was answered, replaced once by a new one.
    """

    def __init__(self, secret: bytes, store: BlockStore, opts: FetchOptions, max_idle_per_peer: int = 8):
        self._secret = secret
        self._store = store
        self.opts = opts
        self._max_idle = max_idle_per_peer
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self._lock = threading.Lock()

    def __enter__(self) -> PeerConnections:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every idle connection (checked-out ones close when their fetch ends)."""
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.sock.close()

    def idle_count(self) -> int:
        """Connections waiting in the pool (for tests and logs)."""
        with self._lock:
            return sum(len(c) for c in self._idle.values())

    def _open(self, host: str, port: int, engine_id: str | None) -> _Conn:
        sock, announced = connect(host, port, self._secret, self._store, self.opts, engine_id)
        return _Conn(sock, announced)

    def _checkout(self, host: str, port: int, engine_id: str | None) -> _Conn:
        stale: list[_Conn] = []
        found: _Conn | None = None
        with self._lock:
            idle = self._idle.get((host, port), [])
            while idle and found is None:
                conn = idle.pop()
                usable = (time.monotonic() - conn.idle_since < MAX_IDLE_S
                          and (engine_id is None or conn.engine_id == engine_id)
                          and not wait_readable(conn.sock, 0))  # data or EOF on an idle line: the peer left
                if usable:
                    conn.reused = True
                    found = conn
                else:
                    stale.append(conn)
        for conn in stale:
            conn.sock.close()
        return found if found is not None else self._open(host, port, engine_id)

    def _checkin(self, host: str, port: int, conn: _Conn) -> None:
        conn.idle_since = time.monotonic()
        with self._lock:
            idle = self._idle.setdefault((host, port), [])
            if len(idle) < self._max_idle:
                idle.append(conn)
                return
        conn.sock.close()

    def _exchange(self, plan: FetchPlan, conn: _Conn, request: dict[str, Any]) -> dict[str, Any]:
        """Send ``request`` and read the reply; a stale pooled connection is replaced once."""
        while True:
            try:
                send_frame(conn.sock, request)
                return recv_frame(conn.sock)
            except (WireError, OSError):
                if not conn.reused:
                    raise
            # The prefill side closed this idle connection: nothing was done there; retry on a new one.
            conn.sock.close()
            fresh = self._open(plan.host, plan.port, plan.engine_id)
            conn.sock, conn.engine_id, conn.reused = fresh.sock, fresh.engine_id, False

    def _fetch_part(self, plan: FetchPlan, remote: Sequence[int], local: Sequence[int]) -> tuple[int, float]:
        """Fetch one stream's blocks; returns (bytes, perf_counter when the prefill side answered)."""
        where = f"{plan.host}:{plan.port}"
        opts = self.opts
        conn = self._checkout(plan.host, plan.port, plan.engine_id)  # a FetchError here: never reached the peer
        with _closing_on_error(conn, f"fetch of request {plan.request_id} from {where}"):
            reply = self._exchange(plan, conn, {"op": "fetch", "request_id": plan.request_id,
                                                "block_ids": list(remote),
                                                "blocks_per_message": opts.blocks_per_message})
            answered = time.perf_counter()
            if not reply.get("ok"):
                raise FetchError(f"{where} refused request {plan.request_id}: {str(reply.get('error'))[:300]}")
            expected = int(reply.get("nbytes", -1))
            if expected != len(local) * self._store.layout.block_bytes:
                raise FetchError(f"{where} announced {expected} bytes for {len(local)} blocks")
            got = 0
            layer_runs = self._store.message_layers()
            for part in chunks(local, opts.blocks_per_message):
                for layers in layer_runs:
                    with self._store.writing(part, layers) as views:
                        got += recv_into_views(conn.sock, views)
        self._checkin(plan.host, plan.port, conn)
        return got, answered

    def fetch(self, plan: FetchPlan) -> FetchResult:
        """Fetch every block of ``plan``; raises FetchError. Does not release the lease.

        The destination blocks are only valid when this returns; on error their
        contents are undefined. Either way the caller then calls ``release``
        (after reporting a failure, if ``FetchError.reached_peer``).
        """
        if len(plan.remote_block_ids) != len(plan.local_block_ids):
            raise FetchError(
                f"request {plan.request_id}: {len(plan.remote_block_ids)} remote blocks "
                f"for {len(plan.local_block_ids)} local blocks"
            )
        start = time.perf_counter()
        n = len(plan.local_block_ids)
        if n == 0:
            return FetchResult(0, 0.0, 0)
        nstreams = max(1, min(self.opts.streams, n))
        step = -(-n // nstreams)
        parts = [(plan.remote_block_ids[i : i + step], plan.local_block_ids[i : i + step])
                 for i in range(0, n, step)]
        errors: list[BaseException] = []
        totals = [0] * len(parts)
        answered = [start] * len(parts)

        def run(i: int) -> None:
            try:
                totals[i], answered[i] = self._fetch_part(plan, parts[i][0], parts[i][1])
            except BaseException as exc:  # reported below with the peer named
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(i,), name=f"kv-socket-fetch-{i}")
                   for i in range(1, len(parts))]
        for t in threads:
            t.start()
        run(0)
        for t in threads:
            t.join()
        if errors:
            first = next((e for e in errors if isinstance(e, FetchError)), None)
            if first is None:
                first = FetchError(f"fetch of request {plan.request_id} from {plan.host}:{plan.port} failed: "
                                   f"{errors[0]}")
                first.__cause__ = errors[0]
            first.reached_peer = any(getattr(e, "reached_peer", False) for e in errors)
            raise first
        return FetchResult(sum(totals), time.perf_counter() - start, len(parts), max(answered) - start)

    def stream(self, plan: FetchPlan, track: Callable[[socket.socket | None], None] | None = None) -> FetchResult:
        """Receive a streamed transfer (``plan.stream_key``) into ``plan.local_block_ids``, layer
        by layer as the prefill engine computes it; raises FetchError. Nothing to release after.

        ``track`` is told the connection's socket while it is in use (None after), so that
        another thread can cut it short (``socket.shutdown``) when the request is aborted.
        """
        start = time.perf_counter()
        local = list(plan.local_block_ids)
        where = f"{plan.host}:{plan.port}"
        if plan.stream_key is None or not local:
            raise FetchError(f"request {plan.request_id}: nothing to stream")
        conn = self._checkout(plan.host, plan.port, plan.engine_id)
        if track is not None:
            track(conn.sock)
        try:
            with _closing_on_error(conn, f"stream of request {plan.request_id} from {where}"):
                ask = {"op": "stream", "key": plan.stream_key, "num_tokens": plan.num_tokens,
                       "first_block": plan.first_block, "blocks_per_message": self.opts.blocks_per_message}
                reply = self._exchange(plan, conn, ask)
                if track is not None:  # the exchange may have replaced a stale pooled connection
                    track(conn.sock)
                answered = time.perf_counter()
                if not reply.get("ok"):
                    raise FetchError(f"{where} refused stream {plan.stream_key[:8]}...: "
                                     f"{str(reply.get('error'))[:300]}")
                if reply.get("nbytes") != len(local) * self._store.layout.block_bytes:
                    raise FetchError(f"{where} announced {reply.get('nbytes')!r} bytes for {len(local)} blocks")
                got = self._receive_layers(conn.sock, local, f"{where}: stream of {plan.request_id}")
        finally:
            if track is not None:
                track(None)
        self._checkin(plan.host, plan.port, conn)
        return FetchResult(got, time.perf_counter() - start, 1, answered - start)

    def _receive_layers(self, sock: socket.socket, local: list[int], what: str) -> int:
        """A stream's messages into ``local``, each layer's blocks in order, up to its end; returns
        the bytes received, raises FetchError on an error frame or anything out of order."""
        layers = len(self._store.layout.layers)
        got = 0
        received = [0] * layers
        while True:
            head = recv_frame(sock)
            if head.get("end") is True:
                break
            layer, first, count = head.get("layer"), head.get("start"), head.get("count")
            if not (type(layer) is int and type(first) is int and type(count) is int):
                raise FetchError(f"{what} failed: {str(head.get('error', head))[:300]}")
            if not (0 <= layer < layers and first == received[layer] and 0 < count <= len(local) - first):
                raise FetchError(f"{what}: layer {layer} blocks {first}+{count} out of order ({len(local)} blocks, "
                                 f"{received[layer] if 0 <= layer < layers else '?'} of that layer received)")
            with self._store.writing(local[first : first + count], [layer]) as views:
                got += recv_into_views(sock, views)
            received[layer] += count
        if min(received) != len(local) or head.get("nbytes") != got:
            raise FetchError(f"{what} ended after {got} bytes, {min(received)} of {len(local)} blocks at every layer")
        return got

    def release(self, plan: FetchPlan) -> bool:
        """Tell the prefill side it may free the request's blocks (best effort); for a streamed
        plan, that this side will never read its stream (op ``abandon``)."""
        what = f"stream {plan.stream_key[:8]}..." if plan.stream_key is not None else plan.request_id
        ask = ({"op": "abandon", "key": plan.stream_key} if plan.stream_key is not None
               else {"op": "release", "request_id": plan.request_id})
        try:
            conn = self._checkout(plan.host, plan.port, plan.engine_id)
        except FetchError as exc:
            logger.info("socket KV connector: release of %s skipped: %s", what, exc)
            return False
        try:
            ok = bool(self._exchange(plan, conn, ask).get("ok"))
        except (WireError, OSError, FetchError) as exc:
            conn.sock.close()
            logger.info("socket KV connector: could not release %s on %s:%d: %s", what, plan.host, plan.port, exc)
            return False
        self._checkin(plan.host, plan.port, conn)
        return ok


def fetch(plan: FetchPlan, secret: bytes, store: BlockStore, opts: FetchOptions) -> FetchResult:
    """One fetch on new connections, then release the lease (tools and tests)."""
    with PeerConnections(secret, store, opts) as conns:
        result = conns.fetch(plan)
        conns.release(plan)
        return result


def release_only(plan: FetchPlan, secret: bytes, store: BlockStore, opts: FetchOptions) -> bool:
    """Release a lease on a new connection, without fetching."""
    with PeerConnections(secret, store, opts) as conns:
        return conns.release(plan)
