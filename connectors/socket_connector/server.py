"""Prefill-side listener: authenticated clients fetch leased blocks.

Protocol after the HMAC handshake (see auth.py), all control frames JSON:

    server -> {"ok": true, "layout": [...], "engine_id": ..., "rank": ...}
    client -> {"op": "fetch", "request_id": R, "block_ids": [...], "blocks_per_message": K}
    server -> {"ok": true, "nbytes": N}  then N raw bytes (see layout.py for the order)
           |  {"ok": false, "error": "..."}   (unknown request, blocks not leased)
    client -> {"op": "release", "request_id": R}
    server -> {"ok": true}
    client -> {"op": "stream", "key": K, "num_tokens": T, "first_block": F, "blocks_per_message": K}
    server -> {"ok": true, "nbytes": N, "request_id": R}   (once the request is scheduled here)
              then, as the forward pass writes them, messages
              {"layer": i, "start": s, "count": c} + c blocks of layer i (the request's blocks
              F + s .. F + s + c - 1, in layout.py's order restricted to that layer)
              ending with {"end": true, "nbytes": N}
           |  {"ok": false, "error": "..."}   (unknown key, token count mismatch, stream ended)
    client -> {"op": "abandon", "key": K}   (this decode engine will never read stream K)
    server -> {"ok": true}
    client -> {"op": "bye"}

A connection carries any number of fetches and releases: decode engines keep
theirs open between requests (``client.PeerConnections``), and one idle for
``idle_timeout_s`` is closed here. One thread accepts; each connection gets
its own thread, so a decode engine's parallel streams are served in parallel.

Against peers that are not decode engines (anyone who can reach the port):
with ``allowed_peers`` set, a connection from any other address is closed as
soon as it is accepted (no thread, no handshake; counted in
``num_refused_peers``, logged at most once per 10 s); at most
``max_pending_handshakes_per_source`` connections from one source address (an
IPv4 address, an IPv6 /64) and ``max_pending_handshakes`` from all together
may be authenticating at once (more are closed as soon as they are accepted,
so strangers on one address cannot lock out a decode engine on another); the
whole authentication must end within ``handshake_timeout_s``; a failed thread
start closes that connection and the listener goes on; every size a peer
sends is checked before it is used (frame lengths, request ids, block lists:
integers, distinct, no longer than the lease, ``blocks_per_message``
clamped), and a bad one is refused with a log line naming the peer.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeGuard

from .auth import HANDSHAKE_TIMEOUT_S, AuthError, listener_id, server_handshake
from .config import BLOCKS_PER_MESSAGE, MAX_PENDING_HANDSHAKES, MAX_PENDING_HANDSHAKES_PER_SOURCE
from .counters import TransferCounters
from .layout import BlockStore, LayoutError
from .leases import LeaseTable
from .params import is_request_id, is_stream_key
from .streams import Stream, StreamClosed, StreamTable
from .wire import (
    FrameError,
    PeerClosed,
    WireError,
    recv_frame,
    send_frame,
    send_views,
    set_io_timeout,
    wait_readable,
)

logger = logging.getLogger(__name__)

#: Largest ``blocks_per_message`` honoured; larger asks are clamped to it.
MAX_BLOCKS_PER_MESSAGE = 1024
#: While a stream waits for the forward pass, how often it looks whether the decode side left.
STREAM_POLL_S = 0.25
#: The accept loop's accept() timeout: how often it looks whether close() was called (close() waits for it).
ACCEPT_POLL_S = 0.5
#: At most one "over the cap" / "thread start failed" log line per this many seconds.
_LOG_EVERY_S = 10.0
#: accept() errors that say "not now" (out of descriptors or memory, a peer gone): wait and go on.
_ACCEPT_RETRY = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED, errno.EPROTO,
                 errno.EPERM, errno.EINTR}


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``text`` as an IP address (an IPv4-mapped IPv6 address as the IPv4 one), or None."""
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def peer_ip(host: str) -> str:
    """An accepted peer's address in the form :func:`resolve_peers` gives (scope id dropped)."""
    ip = _ip(host.split("%", 1)[0])
    return str(ip) if ip is not None else host


def source_of(host: str) -> str:
    """The pre-authentication budget's key for a peer address: the IPv4 address, or the /64 of an
    IPv6 address (one machine commonly holds a whole /64)."""
    ip = _ip(host.split("%", 1)[0])
    if ip is None:
        return host
    if ip.version == 6:
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


def resolve_peers(entries: Sequence[str]) -> frozenset[str]:
    """The addresses ``allowed_peers`` names (:func:`peer_ip` form): IP addresses as they are, host
    names resolved now (``KVServer.start`` calls this once). Raises OSError naming an entry that
    does not resolve."""
    out: set[str] = set()
    for entry in entries:
        ip = _ip(entry.split("%", 1)[0])
        if ip is not None:
            out.add(str(ip))
            continue
        try:
            infos = socket.getaddrinfo(entry, None, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise OSError(f"socket KV connector: allowed_peers entry {entry!r} does not resolve: {exc}") from exc
        out.update(peer_ip(str(info[4][0])) for info in infos)
    return frozenset(out)


def start_thread(target: Callable[..., None], args: tuple[object, ...], name: str) -> None:
    """Start a daemon thread (a seam for tests: ``Thread.start`` can raise RuntimeError)."""
    threading.Thread(target=target, args=args, name=name, daemon=True).start()


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def chunks(items: Sequence[int], size: int) -> list[Sequence[int]]:
    """Split ``items`` into consecutive runs of at most ``size``."""
    return [items[i : i + size] for i in range(0, len(items), max(1, size))]


class KVServer:
    """Serves leased KV blocks to authenticated decode engines."""

    def __init__(
        self,
        store: BlockStore,
        leases: LeaseTable,
        secret: bytes,
        host: str,
        port: int,
        *,
        engine_id: str = "",
        rank: int = 0,
        io_timeout_s: float = 30.0,
        registration_wait_s: float = 5.0,
        idle_timeout_s: float = 120.0,
        counters: TransferCounters | None = None,
        max_pending_handshakes: int = MAX_PENDING_HANDSHAKES,
        max_pending_per_source: int = MAX_PENDING_HANDSHAKES_PER_SOURCE,
        allowed_peers: Sequence[str] = (),
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
        streams: StreamTable | None = None,
        stream_wait_s: float = 20.0,
    ):
        self.store = store
        self.leases = leases
        self._secret = secret
        self.host, self.port = host, port
        self.engine_id, self.rank = engine_id, rank
        self.io_timeout_s = io_timeout_s
        self.registration_wait_s = registration_wait_s
        self.idle_timeout_s = idle_timeout_s
        self.counters = counters or TransferCounters()
        self.max_pending_handshakes = max(1, max_pending_handshakes)
        self.max_pending_per_source = max(1, max_pending_per_source)
        #: ``allowed_peers`` as given; resolved by start() into _allowed (None: any address may try)
        self.allowed_peers = tuple(allowed_peers)
        self._allowed: frozenset[str] | None = None
        self.handshake_timeout_s = handshake_timeout_s
        #: streamed transfers (op ``stream``); None: this listener serves fetches only
        self.streams = streams
        self.stream_wait_s = stream_wait_s
        self._pending = 0  # connections accepted and not yet authenticated (or refused)
        self._pending_by_source: dict[str, int] = {}  # the same per source_of(address); no zero entries
        self._pending_lock = threading.Lock()
        self._suppressed: dict[str, tuple[float, int]] = {}  # log key -> (last logged, suppressed since)
        self._sock: socket.socket | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Resolve ``allowed_peers``, bind ``host:port`` and start accepting; raises OSError naming
        the address, or an ``allowed_peers`` entry that does not resolve."""
        if self.allowed_peers:
            self._allowed = resolve_peers(self.allowed_peers)
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as exc:
            sock.close()
            raise OSError(exc.errno, f"socket KV connector cannot listen on {self.host}:{self.port}: {exc}") from exc
        sock.listen(64)
        sock.settimeout(ACCEPT_POLL_S)
        self.port = sock.getsockname()[1]
        self._sock = sock
        self._thread = threading.Thread(target=self._accept_loop, name=f"kv-socket-listen-{self.port}", daemon=True)
        self._thread.start()
        logger.info("socket KV connector listening on %s:%d (rank %d; connections from %s)", self.host, self.port,
                    self.rank, "any address" if self._allowed is None else ", ".join(sorted(self._allowed)))

    def close(self) -> None:
        """Stop accepting (idempotent); connection threads end with their clients."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    @property
    def pending_handshakes(self) -> int:
        """Connections accepted that have not finished authenticating."""
        with self._pending_lock:
            return self._pending

    def _log_limited(self, key: str, msg: str, *args: object) -> None:
        """A warning at most once per _LOG_EVERY_S per ``key``, saying how many were left out."""
        now = time.monotonic()
        last, left_out = self._suppressed.get(key, (float("-inf"), 0))
        if now - last < _LOG_EVERY_S:
            self._suppressed[key] = (last, left_out + 1)
            return
        self._suppressed[key] = (now, 0)
        suffix = f" ({left_out} more like it not logged)" if left_out else ""
        logger.warning(msg + suffix, *args)

    def pending_from(self, host: str) -> int:
        """Connections from ``host``'s source (:func:`source_of`) that have not finished authenticating."""
        with self._pending_lock:
            return self._pending_by_source.get(source_of(host), 0)

    def _admit(self, source: str, listed: bool = False) -> str | None:
        """Take a pre-authentication slot for a connection from ``source``; None when taken, else
        the cap that is full (the accept loop closes the connection). A ``listed`` source (one of
        ``allowed_peers``: a decode host, whose engine may open a burst of connections at once)
        is held to the global cap only."""
        with self._pending_lock:
            mine = self._pending_by_source.get(source, 0)
            if mine >= self.max_pending_per_source and not listed:
                return "max_pending_handshakes_per_source"
            if self._pending >= self.max_pending_handshakes:
                return "max_pending_handshakes"
            self._pending += 1
            self._pending_by_source[source] = mine + 1
            return None

    def _end_pending(self, source: str) -> None:
        """Give back the slot :meth:`_admit` took (the handshake ended, or its thread never started)."""
        with self._pending_lock:
            self._pending -= 1
            left = self._pending_by_source.get(source, 0) - 1
            if left > 0:
                self._pending_by_source[source] = left
            else:
                self._pending_by_source.pop(source, None)

    def _accept_loop(self) -> None:
        sock = self._sock
        assert sock is not None
        while not self._stop.is_set():
            try:
                conn, addr = sock.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stop.is_set() or exc.errno not in _ACCEPT_RETRY:
                    break
                self._log_limited("accept", "socket KV connector on %s:%d: accept failed: %s; retrying",
                                  self.host, self.port, exc)
                self._stop.wait(0.05)
                continue
            peer = f"{addr[0]}:{addr[1]}"
            # counted and logged before the close, so whoever sees the close sees the count
            if self._allowed is not None and peer_ip(str(addr[0])) not in self._allowed:
                self.counters.add("num_refused_peers")
                self._log_limited("stranger", "socket KV connector closed a connection from %s: not an "
                                  "allowed_peers address", peer)
                conn.close()
                continue
            source = source_of(str(addr[0]))
            full = self._admit(source, listed=self._allowed is not None)
            if full is not None:
                self.counters.add("num_refused")
                self._log_limited(full, "socket KV connector closed a connection from %s: %d connections "
                                  "already authenticating (%s)", peer,
                                  self.max_pending_per_source if full.endswith("per_source")
                                  else self.max_pending_handshakes, full)
                conn.close()
                continue
            try:
                start_thread(self._serve, (conn, addr, source), "kv-socket-conn")
            except RuntimeError as exc:  # can't start new thread: out of memory or a thread limit
                self._end_pending(source)
                conn.close()
                self._log_limited("thread", "socket KV connector closed a connection from %s: cannot start "
                                  "a thread for it: %s", peer, exc)

    def _refuse(self, conn: socket.socket, peer: str, why: str) -> None:
        logger.warning("socket KV connector refused %s: %s", peer, why)
        self.counters.add("num_refused")
        try:
            send_frame(conn, {"ok": False, "error": why})
        except OSError:
            pass

    def _serve(self, conn: socket.socket, addr: tuple[Any, ...], source: str) -> None:
        """One connection's thread (started by the accept loop holding a slot of ``source``'s
        pre-authentication budget, given back when the handshake ends)."""
        peer = f"{addr[0]}:{addr[1]}"
        with conn:
            try:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                server_handshake(conn, self._secret, listener_id(self.host, self.port),
                                 min(self.handshake_timeout_s, self.io_timeout_s))
            except AuthError as exc:
                logger.warning("socket KV connector refused unauthenticated connection from %s: %s", peer, exc)
                self.counters.add("num_refused")
                return
            except (WireError, OSError) as exc:
                logger.warning("socket KV connector: handshake with %s failed: %s", peer, exc)
                return
            finally:
                self._end_pending(source)
            try:
                set_io_timeout(conn, self.io_timeout_s)
                send_frame(
                    conn,
                    {"ok": True, "layout": self.store.layout.fingerprint(), "engine_id": self.engine_id,
                     "rank": self.rank},
                )
                while not self._stop.is_set():
                    if not wait_readable(conn, self.idle_timeout_s):
                        return  # idle too long: the client opens a new connection when it needs one
                    msg = recv_frame(conn)
                    op = msg.get("op")
                    if op == "fetch":
                        if not self._fetch(conn, peer, msg):
                            return
                    elif op == "stream":
                        if not self._stream(conn, peer, msg):
                            return
                    elif op == "release":
                        rid = msg.get("request_id")
                        if not self._valid_request_id(rid):
                            self._refuse(conn, peer, f"malformed request id {_short(rid)} in release")
                            return
                        if self.streams is not None and self.streams.streaming(rid):
                            # a streamed request's lease ends with its stream (a release now would free
                            # blocks the stream may still read)
                            send_frame(conn, {"ok": False, "error": f"request {rid} is streamed"})
                            continue
                        ok = self.leases.release(rid)
                        send_frame(conn, {"ok": ok} if ok else {"ok": False, "error": f"request {rid} not leased"})
                    elif op == "abandon":
                        if not self._abandon(conn, peer, msg.get("key")):
                            return
                    elif op == "bye":
                        return
                    else:
                        self._refuse(conn, peer, f"unknown op {_short(op)}")
                        return
            except PeerClosed:
                return
            except FrameError as exc:
                logger.warning("socket KV connector refused %s: %s; closing the connection", peer, exc)
                self.counters.add("num_refused")
            except (WireError, OSError) as exc:
                logger.info("socket KV connector: connection from %s ended: %s", peer, exc)
            except Exception:  # a bug must cost this connection only, never the listener or the engine
                logger.exception("socket KV connector: serving %s failed", peer)

    @staticmethod
    def _valid_request_id(rid: object) -> TypeGuard[str]:
        """The request id of a fetch or release: :func:`.params.is_request_id`, the prefill scheduler's check."""
        return is_request_id(rid)

    def _stream_key(self, conn: socket.socket, peer: str, key: object, where: str = ""
                    ) -> tuple[StreamTable, str] | None:
        """This listener's stream table and ``key``, checked for a stream op (``stream``, ``abandon``);
        None once the peer was refused (no streams here, or a malformed key): the connection must close."""
        if self.streams is None:
            self._refuse(conn, peer, "this listener does not stream")
            return None
        if not is_stream_key(key):
            self._refuse(conn, peer, f"malformed stream key {_short(key)}{where}")
            return None
        return self.streams, key

    def _stream(self, conn: socket.socket, peer: str, msg: dict[str, Any]) -> bool:
        """Serve one streamed transfer; False when the connection must close."""
        key, num_tokens, first = msg.get("key"), msg.get("num_tokens"), msg.get("first_block")
        per_msg = msg.get("blocks_per_message", BLOCKS_PER_MESSAGE)
        checked = self._stream_key(conn, peer, key)
        if checked is None:
            return False
        streams, key = checked
        if (type(num_tokens) is not int or num_tokens < 1 or type(first) is not int or first < 0
                or type(per_msg) is not int or per_msg < 1):
            self._refuse(conn, peer, "malformed stream request: num_tokens, first_block and blocks_per_message "
                                     "must be integers (>= 1, >= 0, >= 1)")
            return False
        per_msg = min(per_msg, MAX_BLOCKS_PER_MESSAGE)
        asked = time.perf_counter()
        stream = streams.attach(key, self.stream_wait_s, num_tokens, first, conn)
        if isinstance(stream, str):
            self._refuse(conn, peer, f"no stream {key[:8]}... to read here: {stream}")
            return True
        total = -(-stream.num_tokens // streams.block_size)
        sent_bytes = 0
        complete = detached = False
        try:
            count = total - first
            waited = time.perf_counter() - asked
            send_frame(conn, {"ok": True, "nbytes": count * self.store.layout.block_bytes,
                              "request_id": stream.request_id})
            sent = [0] * len(self.store.layout.layers)
            sending = 0.0   # seconds in send calls
            messages = 0
            lag = 0.0       # most seconds between a layer's blocks being written and their send starting
            try:
                stalled_since = time.monotonic()
                while min(sent) < count:
                    todo = streams.wait_progress(stream, sent, first, per_msg, STREAM_POLL_S)
                    if not todo:
                        if wait_readable(conn, 0):  # EOF (or a stray frame): the decode side gave up
                            raise StreamClosed("the decode side closed the connection")
                        if time.monotonic() - stalled_since > self.io_timeout_s:
                            raise StreamClosed(f"no progress for {self.io_timeout_s:g} s")
                        continue
                    stalled_since = time.monotonic()
                    for layer, start, n in todo:
                        with streams.reading(stream) as (ids, events):
                            if events[layer] is not None:
                                events[layer].synchronize()
                            part = ids[first + start : first + start + n]
                            began = time.perf_counter()
                            if stream.ready_at:
                                lag = max(lag, time.monotonic() - stream.ready_at[layer])
                            with self.store.reading(part, [layer]) as views:
                                send_frame(conn, {"layer": layer, "start": start, "count": n})
                                sent_bytes += send_views(conn, views)
                            sending += time.perf_counter() - began
                            messages += 1
                        sent[layer] = start + n
            except StreamClosed as exc:
                logger.info("socket KV connector: stream of %s to %s ended after %.2f MB: %s", stream.request_id,
                            peer, sent_bytes / 1e6, exc)
                send_frame(conn, {"ok": False, "error": f"stream of request {stream.request_id} ended: {exc}"})
                return True
            # every byte is in the kernel's buffers: the blocks are free before D hears the end, so a
            # request finishing after D saw it finds the stream done and releases its lease at once
            self._detach(streams, stream)
            detached = True
            send_frame(conn, {"end": True, "nbytes": sent_bytes})
            complete = True
            self.counters.add("bytes_served", sent_bytes)
            done = time.monotonic()
            computed = f"{(done - stream.computed_at) * 1e3:.1f} ms" if stream.computed_at is not None else "?"
            logger.info("socket KV connector: streamed %s (%d blocks, %.2f MB) to %s in %.1f ms (%.1f ms of it "
                        "waiting for the request to be scheduled; %d messages, %.1f ms in send calls, at most %.1f "
                        "ms from a layer written to its send; the last byte left %s after the prompt was computed)",
                        stream.request_id, count, sent_bytes / 1e6, peer, (time.perf_counter() - asked) * 1e3,
                        waited * 1e3, messages, sending * 1e3, lag * 1e3, computed)
            return True
        finally:
            if not detached:
                self._detach(streams, stream)
            if not complete:
                self.counters.add("bytes_served", sent_bytes)

    def _abandon(self, conn: socket.socket, peer: str, key: object) -> bool:
        """A decode engine will never read stream ``key``: its lease ends (streams.abandon); False
        when the connection must close."""
        checked = self._stream_key(conn, peer, key, " in abandon")
        if checked is None:
            return False
        streams, key = checked
        release = streams.abandon(key)
        if release is not None:
            self.leases.release(release)
        logger.info("socket KV connector: %s abandoned stream %s...%s", peer, key[:8],
                    f" (request {release}: its lease released)" if release is not None else "")
        send_frame(conn, {"ok": True})
        return True

    def _detach(self, streams: StreamTable, stream: Stream) -> None:
        """The decode side is done with ``stream``; release the lease of a request that already finished."""
        release = streams.detach(stream)
        if release is not None:
            self.leases.release(release)

    def _fetch(self, conn: socket.socket, peer: str, msg: dict[str, Any]) -> bool:
        rid = msg.get("request_id")
        if not self._valid_request_id(rid):
            self._refuse(conn, peer, f"malformed request id {_short(rid)} in fetch")
            return False
        assert isinstance(rid, str)
        block_ids = msg.get("block_ids")
        if not isinstance(block_ids, list) or not all(type(b) is int for b in block_ids):
            self._refuse(conn, peer, f"malformed fetch for request {rid}: block_ids must be a list of integers")
            return False
        per_msg = msg.get("blocks_per_message", BLOCKS_PER_MESSAGE)
        if type(per_msg) is not int or per_msg < 1:
            self._refuse(conn, peer, f"malformed fetch for request {rid}: blocks_per_message must be a "
                                     f"positive integer, got {_short(per_msg)}")
            return False
        per_msg = min(per_msg, MAX_BLOCKS_PER_MESSAGE)
        asked = time.perf_counter()
        lease = self.leases.acquire(rid, self.registration_wait_s)
        waited = time.perf_counter() - asked
        if lease is None:
            self._refuse(conn, peer, f"unknown, released or expired request {rid}")
            return False
        sent = 0
        try:
            if len(block_ids) > len(lease.block_ids):
                self._refuse(conn, peer, f"fetch of {len(block_ids)} blocks for request {rid}, "
                                         f"whose lease holds {len(lease.block_ids)}")
                return False
            if len(set(block_ids)) != len(block_ids):
                self._refuse(conn, peer, f"fetch for request {rid} repeats block ids")
                return False
            if not set(block_ids) <= lease.allowed:
                self._refuse(conn, peer, f"blocks not leased to request {rid}")
                return False
            try:
                self.store.layout.check_blocks(block_ids)
            except LayoutError as exc:
                self._refuse(conn, peer, str(exc))
                return False
            send_frame(conn, {"ok": True, "nbytes": len(block_ids) * self.store.layout.block_bytes})
            layer_runs = self.store.message_layers()
            for part in chunks(block_ids, per_msg):
                for layers in layer_runs:
                    with self.store.reading(part, layers) as views:
                        sent += send_views(conn, views)
            self.counters.add("bytes_served", sent)
            logger.info("socket KV connector: served %s (%d blocks, %.2f MB) to %s in %.1f ms "
                        "(%.1f ms of it waiting for the lease)", rid, len(block_ids), sent / 1e6, peer,
                        (time.perf_counter() - asked) * 1e3, waited * 1e3)
            return True
        finally:
            self.leases.end_fetch(lease, sent)
