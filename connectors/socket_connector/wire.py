"""Framing for the socket KV connector: JSON control frames and raw block data.

A control frame is a 4-byte big-endian length followed by that many bytes of
UTF-8 JSON (one object). Block data follows a ``fetch`` reply as a plain byte
stream whose order both sides derive from the block ids and the KV layout, so
it carries no per-block headers: the sender writes straight from tensor
memory (``sendmsg`` over many memoryviews) and the receiver reads straight
into its destination (``recv_into``).
"""

from __future__ import annotations

import json
import select
import socket
import struct
import time
from collections.abc import Sequence
from typing import Any

#: Largest control frame accepted (block id lists of long prompts fit easily).
MAX_FRAME_BYTES = 4 << 20
#: iovecs per sendmsg call; Linux's IOV_MAX is 1024.
MAX_IOVECS = 512

_LEN = struct.Struct(">I")
_TIMEVAL = struct.Struct("@ll")
#: What a blocking socket raises when SO_RCVTIMEO / SO_SNDTIMEO expire.
_TIMED_OUT = (TimeoutError, BlockingIOError)


class WireError(ConnectionError):
    """The peer closed the connection, sent a malformed frame or timed out."""


class FrameError(WireError):
    """The peer sent a control frame that is too large or not a JSON object."""


class PeerClosed(WireError):
    """The peer closed the connection cleanly, between two messages."""


def set_io_timeout(sock: socket.socket, seconds: float) -> None:
    """Make ``sock`` blocking with kernel-side send and receive timeouts.

    A socket with a Python timeout is non-blocking underneath, so every
    partial read returns to Python (and waits for the GIL, which an engine's
    busy loop holds). A blocking socket with ``SO_RCVTIMEO`` lets one
    ``recv_into(MSG_WAITALL)`` fill a whole block in the kernel. The timeout
    then bounds each wait for progress, not the whole transfer.
    """
    sock.settimeout(None)
    whole = int(seconds)
    tv = _TIMEVAL.pack(whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def wait_readable(sock: socket.socket, seconds: float) -> bool:
    """True once ``sock`` has data (or EOF) to read, False after ``seconds``."""
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
    return bool(poller.poll(int(seconds * 1000)))


def send_frame(sock: socket.socket, obj: dict[str, Any]) -> None:
    """Send one JSON control frame."""
    body = json.dumps(obj, separators=(",", ":")).encode()
    if len(body) > MAX_FRAME_BYTES:
        raise WireError(f"control frame of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
    sock.sendall(_LEN.pack(len(body)) + body)


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """Read exactly ``n`` bytes (small reads only: control data); ``deadline`` as in recv_into_views."""
    buf = bytearray(n)
    recv_into_views(sock, [memoryview(buf)], deadline)
    return bytes(buf)


def recv_frame(sock: socket.socket, max_bytes: int = MAX_FRAME_BYTES,
               deadline: float | None = None) -> dict[str, Any]:
    """Receive one JSON control frame of at most ``max_bytes``; raises WireError on EOF or garbage.

    The length header is checked before anything else is read or allocated.
    """
    (length,) = _LEN.unpack(recv_exact(sock, _LEN.size, deadline))
    if length > max_bytes:
        raise FrameError(f"peer announced a control frame of {length} bytes (max {max_bytes})")
    try:
        obj = json.loads(recv_exact(sock, length, deadline))
    except (ValueError, RecursionError) as exc:  # RecursionError: absurdly nested JSON
        raise FrameError(f"malformed control frame: {str(exc)[:100]}") from exc
    if not isinstance(obj, dict):
        raise FrameError("control frame is not a JSON object")
    return obj


def send_views(sock: socket.socket, views: Sequence[memoryview]) -> int:
    """Send every byte of ``views`` in order with scatter-gather writes.

    Handles partial writes (``sendmsg`` may stop mid-view) and returns the
    number of bytes sent. The views are read in place: nothing is copied in
    user space.
    """
    total = 0
    pending = [v.cast("B") if v.format != "B" or v.ndim != 1 else v for v in views if v.nbytes]
    i = 0
    while i < len(pending):
        batch = pending[i : i + MAX_IOVECS]
        try:
            sent = sock.sendmsg(batch)
        except _TIMED_OUT as exc:
            raise WireError("timed out sending block data") from exc
        except OSError as exc:
            raise WireError(f"sending block data failed: {exc}") from exc
        total += sent
        i = _advance(pending, i, sent)
    return total


def recv_into_views(sock: socket.socket, views: Sequence[memoryview], deadline: float | None = None) -> int:
    """Fill every view in order straight from the socket; returns bytes read.

    Scatter-gather reads of up to MAX_IOVECS views with ``MSG_WAITALL``: on a
    blocking socket (see ``set_io_timeout``) the kernel fills them all before
    returning, so a whole message of blocks costs one system call and one
    return to Python (whose GIL an engine's busy loop may hold). Raises
    WireError if the peer closes before all bytes arrived (a partial
    transfer) or the socket times out.

    ``deadline`` (``time.monotonic()`` value, for the handshake): the whole
    read must end by then. Without it the socket's timeout bounds each wait
    for progress, so a peer trickling a byte just inside it could hold the
    read for ever; with it each system call gets only the time left.
    """
    total = 0
    pending = [v.cast("B") if v.format != "B" or v.ndim != 1 else v for v in views if v.nbytes]
    i = 0
    while i < len(pending):
        batch = pending[i : i + MAX_IOVECS]
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WireError(f"deadline passed after {total} bytes")
            set_io_timeout(sock, max(left, 0.001))  # 0 would mean no timeout at all
        try:
            n = sock.recvmsg_into(batch, 0, socket.MSG_WAITALL)[0]
        except _TIMED_OUT as exc:
            if deadline is not None:
                raise WireError(f"deadline passed after {total} bytes") from exc
            raise WireError(f"timed out after {total} bytes") from exc
        except OSError as exc:
            raise WireError(f"receive failed after {total} bytes: {exc}") from exc
        if n == 0:
            if total == 0:
                raise PeerClosed("peer closed the connection")
            raise WireError(f"peer closed the connection after {total} bytes (partial transfer)")
        total += n
        i = _advance(pending, i, n)
    return total


def _advance(pending: list[memoryview], i: int, done: int) -> int:
    """Skip the views ``done`` bytes fill from ``pending[i]`` on, trimming a partly done one."""
    while done:
        head = pending[i]
        if done >= head.nbytes:
            done -= head.nbytes
            i += 1
        else:
            pending[i] = head[done:]
            done = 0
    return i


def coalesce(views: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge (address, length) extents that abut in memory, keeping order."""
    out: list[tuple[int, int]] = []
    for addr, length in views:
        if out and out[-1][0] + out[-1][1] == addr:
            out[-1] = (out[-1][0], out[-1][1] + length)
        else:
            out.append((addr, length))
    return out
