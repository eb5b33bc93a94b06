"""Prefill-side listener: authenticated clients fetch leased blocks.

Protocol after the HMAC handshake (see auth.py), all control frames JSON:

    server -> {"ok": true, "layout": [...], "engine_id": ..., "rank": ...}
    client -> {"op": "fetch", "request_id": R, "block_ids": [...], "blocks_per_message": K}
    server -> {"ok": true, "nbytes": N}  then N raw bytes (see layout.py for the order)
           |  {"ok": false, "error": "..."}   (unknown request, blocks not leased)
    client -> {"op": "release", "request_id": R}
    server -> {"ok": true}
    client -> {"op": "bye"}

A connection carries any number of fetches and releases: decode engines keep
theirs open between requests (``client.PeerConnections``), and one idle for
``idle_timeout_s`` is closed here. One thread accepts; each connection gets
its own thread, so a decode engine's parallel streams are served in parallel.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Sequence

from disagg_connectors.socket_connector.auth import AuthError, server_handshake
from disagg_connectors.socket_connector.counters import TransferCounters
from disagg_connectors.socket_connector.layout import BlockStore, LayoutError
from disagg_connectors.socket_connector.leases import LeaseTable
from disagg_connectors.socket_connector.wire import (
    PeerClosed,
    WireError,
    recv_frame,
    send_frame,
    send_views,
    set_io_timeout,
    wait_readable,
)

logger = logging.getLogger(__name__)


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
        self._sock: socket.socket | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Bind ``host:port`` and start accepting; raises OSError naming the address."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as exc:
            sock.close()
            raise OSError(exc.errno, f"socket KV connector cannot listen on {self.host}:{self.port}: {exc}") from exc
        sock.listen(64)
        sock.settimeout(0.5)
        self.port = sock.getsockname()[1]
        self._sock = sock
        self._thread = threading.Thread(target=self._accept_loop, name=f"kv-socket-listen-{self.port}", daemon=True)
        self._thread.start()
        logger.info("socket KV connector listening on %s:%d (rank %d)", self.host, self.port, self.rank)

    def close(self) -> None:
        """Stop accepting (idempotent); connection threads end with their clients."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                conn, addr = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            threading.Thread(target=self._serve, args=(conn, addr), name="kv-socket-conn", daemon=True).start()

    def _refuse(self, conn: socket.socket, peer: str, why: str) -> None:
        logger.warning("socket KV connector refused %s: %s", peer, why)
        self.counters.add("num_refused")
        try:
            send_frame(conn, {"ok": False, "error": why})
        except OSError:
            pass

    def _serve(self, conn: socket.socket, addr: tuple) -> None:
        peer = f"{addr[0]}:{addr[1]}"
        with conn:
            set_io_timeout(conn, self.io_timeout_s)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                server_handshake(conn, self._secret)
            except AuthError as exc:
                logger.warning("socket KV connector refused unauthenticated connection from %s: %s", peer, exc)
                self.counters.add("num_refused")
                return
            except (WireError, OSError) as exc:
                logger.warning("socket KV connector: handshake with %s failed: %s", peer, exc)
                return
            try:
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
                    elif op == "release":
                        rid = str(msg.get("request_id"))
                        ok = self.leases.release(rid)
                        send_frame(conn, {"ok": ok} if ok else {"ok": False, "error": f"request {rid} not leased"})
                    elif op == "bye":
                        return
                    else:
                        self._refuse(conn, peer, f"unknown op {op!r}")
                        return
            except PeerClosed:
                return
            except (WireError, OSError) as exc:
                logger.info("socket KV connector: connection from %s ended: %s", peer, exc)

    def _fetch(self, conn: socket.socket, peer: str, msg: dict) -> bool:
        rid = str(msg.get("request_id"))
        try:
            block_ids = [int(b) for b in msg.get("block_ids", [])]
            per_msg = max(1, int(msg.get("blocks_per_message", 64)))
        except (TypeError, ValueError):
            self._refuse(conn, peer, f"malformed fetch for request {rid}")
            return False
        asked = time.perf_counter()
        lease = self.leases.acquire(rid, self.registration_wait_s)
        waited = time.perf_counter() - asked
        if lease is None:
            self._refuse(conn, peer, f"unknown, released or expired request {rid}")
            return False
        sent = 0
        try:
            if not set(block_ids) <= lease.allowed:
                self._refuse(conn, peer, f"blocks not leased to request {rid}")
                return False
            try:
                self.store.layout.check_blocks(block_ids)
            except LayoutError as exc:
                self._refuse(conn, peer, str(exc))
                return False
            send_frame(conn, {"ok": True, "nbytes": len(block_ids) * self.store.layout.block_bytes})
            for part in chunks(block_ids, per_msg):
                with self.store.reading(part) as views:
                    sent += send_views(conn, views)
            self.counters.add("bytes_served", sent)
            logger.info("socket KV connector: served %s (%d blocks, %.2f MB) to %s in %.1f ms "
                        "(%.1f ms of it waiting for the lease)", rid, len(block_ids), sent / 1e6, peer,
                        (time.perf_counter() - asked) * 1e3, waited * 1e3)
            return True
        finally:
            self.leases.end_fetch(lease, sent)
