"""Mutual HMAC challenge-response for the socket KV connector, bound to the listener.

The shared secret never crosses the wire. The server (prefill side) opens
with ``MAGIC`` and a random nonce; the client (decode side) answers with its
own nonce and ``HMAC(secret, MAGIC | "kv-client" | L | server_nonce |
client_nonce)``; the server checks it and proves itself with
``HMAC(secret, MAGIC | "kv-server" | L | client_nonce | server_nonce)``.
Both sides compare with ``hmac.compare_digest``.

``L`` is the listener's identity, ``host:port`` (``listener_id``): the client
uses the address it dialled, the server the address it listens on, which is
the one the prefill engine advertises in ``remote_host``/``remote_port``. A
fake listener that relays the real server's challenge to a decode engine gets
an answer computed for the fake listener's address, which the real server
refuses: a relayed challenge authenticates nobody. The labels keep the two
directions apart (an answer cannot be reflected as a proof).

The whole exchange has one deadline (``timeout_s``, default 5 s) on both
sides, whatever the socket's per-read timeout: a peer trickling bytes cannot
hold a listener thread longer than that.

What this does not do: it authenticates the connection's start only. The KV
stream after it is neither encrypted nor integrity-protected (see
docs/socket-connector.md, "Security").
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import time

from .wire import WireError, recv_exact, recv_frame, send_frame, set_io_timeout

#: Protocol greeting; the digit is the protocol version (DKV1 had no listener binding).
MAGIC = b"DKV2"
NONCE_BYTES = 32
DIGEST = hashlib.sha256
MIN_SECRET_BYTES = 16
#: Default deadline for the whole authentication exchange, seconds.
HANDSHAKE_TIMEOUT_S = 5.0
#: Largest frame either side reads before the peer has proved the secret.
MAX_HANDSHAKE_FRAME = 4096
#: Longest peer-supplied text quoted in an error.
_QUOTE = 200


class AuthError(WireError):
    """The peer failed the challenge (wrong secret, relayed challenge) or spoke another protocol."""


def check_secret(secret: bytes) -> bytes:
    """Refuse secrets too short to be one ``disagg up`` generated."""
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the KV connector secret must be at least {MIN_SECRET_BYTES} bytes, got {len(secret)}")
    return secret


def listener_id(host: str, port: int) -> str:
    """The identity both sides put in the transcript: ``host:port`` (``[v6]:port``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _mac(secret: bytes, label: bytes, listener: str, first: bytes, second: bytes) -> bytes:
    ident = listener.encode()
    msg = MAGIC + label + len(ident).to_bytes(4, "big") + ident + first + second
    return hmac.new(secret, msg, DIGEST).digest()


def server_handshake(sock: socket.socket, secret: bytes, listener: str,
                     timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
    """Authenticate the client that just connected to ``listener``; raises AuthError on failure.

    Raises WireError when the exchange does not finish within ``timeout_s``.
    On failure the client is told ``auth failed`` (no detail) before the
    caller closes the connection. Leaves the socket's timeouts at the
    handshake's: the caller sets its own afterwards.
    """
    deadline = time.monotonic() + timeout_s
    set_io_timeout(sock, timeout_s)
    nonce_s = os.urandom(NONCE_BYTES)
    sock.sendall(MAGIC + nonce_s)
    reply = recv_exact(sock, NONCE_BYTES + DIGEST().digest_size, deadline)
    nonce_c, mac_c = reply[:NONCE_BYTES], reply[NONCE_BYTES:]
    if not hmac.compare_digest(mac_c, _mac(secret, b"kv-client", listener, nonce_s, nonce_c)):
        try:
            send_frame(sock, {"ok": False, "error": "auth failed"})
        except OSError:
            pass
        raise AuthError("client failed the HMAC challenge (wrong secret, or a challenge relayed from "
                        "another address?)")
    send_frame(sock, {"ok": True, "mac": _mac(secret, b"kv-server", listener, nonce_c, nonce_s).hex()})


def client_handshake(sock: socket.socket, secret: bytes, listener: str,
                     timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
    """Answer the challenge of the server at ``listener`` (the address dialled) and check its proof.

    Raises AuthError (refused, wrong proof, other protocol) or WireError
    (closed, or not done within ``timeout_s``). Leaves the socket's timeouts
    at the handshake's: the caller sets its own afterwards.
    """
    deadline = time.monotonic() + timeout_s
    set_io_timeout(sock, timeout_s)
    hello = recv_exact(sock, len(MAGIC) + NONCE_BYTES, deadline)
    if hello[: len(MAGIC)] != MAGIC:
        if hello[:3] == MAGIC[:3]:
            raise AuthError(f"peer speaks socket KV protocol {hello[:4]!r}, this engine {MAGIC!r}: "
                            "run the same disagg_connectors version on both engines")
        raise AuthError(f"peer is not a socket KV connector (greeting {hello[:4]!r})")
    nonce_s = hello[len(MAGIC) :]
    nonce_c = os.urandom(NONCE_BYTES)
    sock.sendall(nonce_c + _mac(secret, b"kv-client", listener, nonce_s, nonce_c))
    try:
        answer = recv_frame(sock, MAX_HANDSHAKE_FRAME, deadline)
    except WireError as exc:
        raise AuthError(f"server closed during authentication: {exc}") from exc
    if answer.get("ok") is not True:
        raise AuthError(f"server refused authentication: {str(answer.get('error', 'no reason'))[:_QUOTE]}")
    expected = _mac(secret, b"kv-server", listener, nonce_c, nonce_s)
    try:
        theirs = bytes.fromhex(str(answer.get("mac", ""))[:_QUOTE])
    except ValueError:
        theirs = b""
    if not hmac.compare_digest(theirs, expected):
        raise AuthError("server failed to prove it holds the secret")
