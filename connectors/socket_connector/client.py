"""Decode-side fetch: pull a request's blocks from the prefill engine's listener.

The block list is split into ``streams`` consecutive parts, each fetched on
its own authenticated connection in its own thread, straight into the
destination blocks. After all parts (success or not) the lease is released on
the first connection, so the prefill engine frees its blocks at once.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from disagg_connectors.socket_connector.auth import client_handshake
from disagg_connectors.socket_connector.layout import BlockStore
from disagg_connectors.socket_connector.server import chunks
from disagg_connectors.socket_connector.wire import WireError, recv_frame, recv_into_views, send_frame

logger = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class FetchOptions:
    """Transport knobs (from kv_connector_extra_config)."""

    streams: int = 2
    blocks_per_message: int = 64
    connect_timeout_s: float = 5.0
    io_timeout_s: float = 30.0


@dataclass(frozen=True)
class FetchResult:
    """A finished fetch."""

    nbytes: int
    seconds: float
    streams: int


def connect(host: str, port: int, secret: bytes, store: BlockStore, opts: FetchOptions,
            engine_id: str | None = None) -> socket.socket:
    """Open, authenticate, identity- and layout-check one connection; raises FetchError."""
    where = f"{host}:{port}"
    try:
        sock = socket.create_connection((host, port), timeout=opts.connect_timeout_s)
    except OSError as exc:
        raise FetchError(f"cannot connect to prefill KV listener {where}: {exc}") from exc
    try:
        sock.settimeout(opts.io_timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        client_handshake(sock, secret)
        hello = recv_frame(sock)
        theirs = hello.get("layout")
        ours = store.layout.fingerprint()
        if theirs != ours:
            raise FetchError(f"KV layout of {where} differs from ours: {theirs} != {ours}")
        if engine_id is not None and hello.get("engine_id") != engine_id:
            raise FetchError(f"{where} is engine {hello.get('engine_id')!r}, not {engine_id!r} (restarted?)")
        return sock
    except (WireError, OSError) as exc:
        sock.close()
        raise FetchError(f"handshake with {where} failed: {exc}") from exc
    except FetchError:
        sock.close()
        raise


def _fetch_part(sock: socket.socket, plan: FetchPlan, remote: Sequence[int], local: Sequence[int],
                store: BlockStore, opts: FetchOptions) -> int:
    where = f"{plan.host}:{plan.port}"
    send_frame(sock, {"op": "fetch", "request_id": plan.request_id, "block_ids": list(remote),
                      "blocks_per_message": opts.blocks_per_message})
    reply = recv_frame(sock)
    if not reply.get("ok"):
        raise FetchError(f"{where} refused request {plan.request_id}: {reply.get('error')}")
    expected = int(reply.get("nbytes", -1))
    if expected != len(local) * store.layout.block_bytes:
        raise FetchError(f"{where} announced {expected} bytes for {len(local)} blocks")
    got = 0
    for part in chunks(local, opts.blocks_per_message):
        with store.writing(part) as views:
            got += recv_into_views(sock, views)
    return got


def fetch(plan: FetchPlan, secret: bytes, store: BlockStore, opts: FetchOptions) -> FetchResult:
    """Fetch every block of ``plan`` and release the lease; raises FetchError.

    The destination blocks are only valid when this returns; on error their
    contents are undefined: the caller reports the load as failed and then
    calls ``release_only`` if ``FetchError.reached_peer``.
    """
    if len(plan.remote_block_ids) != len(plan.local_block_ids):
        raise FetchError(
            f"request {plan.request_id}: {len(plan.remote_block_ids)} remote blocks "
            f"for {len(plan.local_block_ids)} local blocks"
        )
    start = time.perf_counter()
    n = len(plan.local_block_ids)
    if n == 0:
        release_only(plan, secret, store, opts)
        return FetchResult(0, time.perf_counter() - start, 0)
    nstreams = max(1, min(opts.streams, n))
    step = -(-n // nstreams)
    parts = [(plan.remote_block_ids[i : i + step], plan.local_block_ids[i : i + step]) for i in range(0, n, step)]
    socks: list[socket.socket] = []
    errors: list[BaseException] = []
    totals = [0] * len(parts)
    try:
        socks.append(connect(plan.host, plan.port, secret, store, opts, plan.engine_id))
        for _ in parts[1:]:
            socks.append(connect(plan.host, plan.port, secret, store, opts, plan.engine_id))

        def run(i: int) -> None:
            try:
                totals[i] = _fetch_part(socks[i], plan, parts[i][0], parts[i][1], store, opts)
            except BaseException as exc:  # reported below with the peer named
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(i,), name=f"kv-socket-fetch-{i}") for i in range(1, len(parts))]
        for t in threads:
            t.start()
        run(0)
        for t in threads:
            t.join()
        if errors:
            exc = errors[0]
            if isinstance(exc, FetchError):
                raise exc
            raise FetchError(f"fetch of request {plan.request_id} from {plan.host}:{plan.port} failed: {exc}") from exc
        release(socks[0], plan)
        return FetchResult(sum(totals), time.perf_counter() - start, len(parts))
    except FetchError as exc:
        # The caller reports the failure first, then releases on a fresh
        # connection (a broken stream may hold unread data) if we ever got in.
        exc.reached_peer = bool(socks)
        raise
    finally:
        for s in socks:
            s.close()


def release(sock: socket.socket, plan: FetchPlan) -> bool:
    """Tell the prefill side it may free the request's blocks (best effort)."""
    try:
        send_frame(sock, {"op": "release", "request_id": plan.request_id})
        ok = bool(recv_frame(sock).get("ok"))
        send_frame(sock, {"op": "bye"})
        return ok
    except (WireError, OSError) as exc:
        logger.info("socket KV connector: could not release %s on %s:%d: %s",
                    plan.request_id, plan.host, plan.port, exc)
        return False


def release_only(plan: FetchPlan, secret: bytes, store: BlockStore, opts: FetchOptions) -> bool:
    """Release a lease without fetching (decode side hit its own cache or aborted)."""
    try:
        sock = connect(plan.host, plan.port, secret, store, opts, plan.engine_id)
    except FetchError as exc:
        logger.info("socket KV connector: release of %s skipped: %s", plan.request_id, exc)
        return False
    with sock:
        return release(sock, plan)
