"""Mutual HMAC challenge-response for the socket KV connector.

The shared secret never crosses the wire. The server (prefill side) opens
with a random nonce; the client (decode side) answers with its own nonce and
``HMAC(secret, "kv-client" | server_nonce | client_nonce)``; the server checks
it and proves itself with ``HMAC(secret, "kv-server" | client_nonce |
server_nonce)``. Both sides compare with ``hmac.compare_digest``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket

from disagg_connectors.socket_connector.wire import WireError, recv_exact, recv_frame, send_frame

MAGIC = b"DKV1"
NONCE_BYTES = 32
DIGEST = hashlib.sha256
MIN_SECRET_BYTES = 16


class AuthError(WireError):
    """The peer failed the challenge (wrong secret) or spoke another protocol."""


def check_secret(secret: bytes) -> bytes:
    """Refuse secrets too short to be one ``disagg up`` generated."""
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the KV connector secret must be at least {MIN_SECRET_BYTES} bytes, got {len(secret)}")
    return secret


def _mac(secret: bytes, label: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(secret, label + a + b, DIGEST).digest()


def server_handshake(sock: socket.socket, secret: bytes) -> None:
    """Authenticate the client that just connected; raises AuthError on failure.

    On failure the client is told ``auth failed`` (no detail) before the
    caller closes the connection.
    """
    nonce_s = os.urandom(NONCE_BYTES)
    sock.sendall(MAGIC + nonce_s)
    reply = recv_exact(sock, NONCE_BYTES + DIGEST().digest_size)
    nonce_c, mac_c = reply[:NONCE_BYTES], reply[NONCE_BYTES:]
    if not hmac.compare_digest(mac_c, _mac(secret, b"kv-client", nonce_s, nonce_c)):
        try:
            send_frame(sock, {"ok": False, "error": "auth failed"})
        except OSError:
            pass
        raise AuthError("client failed the HMAC challenge (wrong secret?)")
    send_frame(sock, {"ok": True, "mac": _mac(secret, b"kv-server", nonce_c, nonce_s).hex()})


def client_handshake(sock: socket.socket, secret: bytes) -> None:
    """Answer the server's challenge and check the server's proof."""
    hello = recv_exact(sock, len(MAGIC) + NONCE_BYTES)
    if hello[: len(MAGIC)] != MAGIC:
        raise AuthError(f"peer is not a socket KV connector (greeting {hello[:4]!r})")
    nonce_s = hello[len(MAGIC) :]
    nonce_c = os.urandom(NONCE_BYTES)
    sock.sendall(nonce_c + _mac(secret, b"kv-client", nonce_s, nonce_c))
    try:
        answer = recv_frame(sock)
    except WireError as exc:
        raise AuthError(f"server closed during authentication: {exc}") from exc
    if not answer.get("ok"):
        raise AuthError(f"server refused authentication: {answer.get('error', 'no reason')}")
    expected = _mac(secret, b"kv-server", nonce_c, nonce_s)
    try:
        theirs = bytes.fromhex(str(answer.get("mac", "")))
    except ValueError:
        theirs = b""
    if not hmac.compare_digest(theirs, expected):
        raise AuthError("server failed to prove it holds the secret")
