"""Checks on client-supplied ``kv_transfer_params`` and the prefill peers a decode engine may dial.

``kv_transfer_params`` reach an engine from whoever can POST to its
``/v1/completions``: the proxy forwards the prefill engine's reply verbatim,
but a client talking to an engine directly can send anything. An exception in
a scheduler hook kills vLLM's engine core, and a ``remote_host`` taken on
trust makes the decode engine dial any address and answer its challenge. So
every field is checked here, explicitly, before the scheduler half uses it:
a check either returns a typed result or a ``Declined`` naming the field.

Nothing here imports vLLM or raises on client input.
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

#: ``transfer`` value the prefill side puts in its params.
TRANSFER_NAME = "socket"
#: Longest host name accepted (DNS limit).
MAX_HOST_CHARS = 253
#: Longest request id either engine accepts (:func:`is_request_id`). vLLM's ids are the proxy's
#: X-Request-Id (at most 128 characters) with vLLM's prefix (``cmpl-``, ``chatcmpl-``) and suffixes.
MAX_REQUEST_ID_CHARS = 512
#: Longest engine id accepted in ``remote_engine_id``.
MAX_ENGINE_ID_CHARS = 512
#: Largest ``tp_size`` accepted.
MAX_TP_SIZE = 64
#: Longest lease accepted, in seconds (also the largest ``kv_lease_duration``).
MAX_LEASE_S = 3600.0
#: Largest block id accepted.
MAX_BLOCK_ID = 2**31 - 1
#: Longest piece of a client's value quoted in a log line.
_QUOTE_CHARS = 40
#: ``kv_transfer_params`` key naming a streamed transfer (both engines get the same value)
STREAM_KEY = "stream_key"
#: a stream key's length bounds and alphabet (the proxy's keys: ``secrets.token_urlsafe(24)``)
MIN_STREAM_KEY_CHARS, MAX_STREAM_KEY_CHARS = 16, 128
_STREAM_KEY_ALPHABET = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")


@dataclass(frozen=True)
class Declined:
    """The params are unusable: ``field`` names the first bad key, ``reason`` says why (short)."""

    field: str
    reason: str


@dataclass(frozen=True)
class RemotePrefill:
    """Validated decode-side params: fetch ``block_ids`` of ``request_id`` from ``host:port``."""

    request_id: str
    host: str
    port: int
    block_ids: tuple[int, ...]
    num_tokens: int
    tp_size: int = 1
    engine_id: str | None = None
    #: streamed transfer: the key P knows the request by (``block_ids`` is then empty)
    stream_key: str | None = None


def is_stream_key(value: Any) -> TypeGuard[str]:
    """A well-formed stream key: 16..128 characters of the URL-safe base64 alphabet."""
    return (isinstance(value, str) and MIN_STREAM_KEY_CHARS <= len(value) <= MAX_STREAM_KEY_CHARS
            and _STREAM_KEY_ALPHABET.issuperset(value))


def stream_key_of(params: Mapping[str, Any]) -> str | Declined | None:
    """The params' stream key: None when absent (or null), Declined when malformed. Never raises."""
    key = params.get(STREAM_KEY)
    if key is None:
        return None
    if not is_stream_key(key):
        return Declined(STREAM_KEY, f"must be {MIN_STREAM_KEY_CHARS}..{MAX_STREAM_KEY_CHARS} characters of "
                                    f"A-Z a-z 0-9 _ -, got {quote(key)}")
    return key


def quote(value: Any) -> str:
    """A short, single-line description of a client's value for a log line."""
    text = repr(value)
    if len(text) > _QUOTE_CHARS:
        text = text[: _QUOTE_CHARS - 3] + "..."
    return f"{type(value).__name__} {text}"


def is_int(value: Any) -> TypeGuard[int]:
    """A real JSON integer: not a bool, float or string."""
    return type(value) is int


def _clean_str(value: Any, max_chars: int) -> TypeGuard[str]:
    return isinstance(value, str) and 0 < len(value) <= max_chars and value.isprintable()


def is_request_id(value: object) -> TypeGuard[str]:
    """A request id both engines accept: 1..:data:`MAX_REQUEST_ID_CHARS` printable ASCII characters,
    no space, no other whitespace or control character. Never raises.

    The one check on both sides of a transfer: the prefill scheduler (``SocketScheduler``) takes no
    lease for a request whose id fails it, the decode scheduler declines ``remote_request_id`` that
    fails it (:func:`check_remote_prefill`), and the listener (``KVServer``) refuses a fetch or release
    naming one. So the prefill side never holds blocks for an id the decode side would refuse."""
    return (isinstance(value, str) and 0 < len(value) <= MAX_REQUEST_ID_CHARS and value.isascii()
            and value.isprintable() and " " not in value)


def _host_key(host: str) -> str:
    """Comparable form of a host: IP literals normalised, names lower-cased (no DNS lookups)."""
    text = host.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    try:
        return ipaddress.ip_address(text).compressed
    except ValueError:
        return text.lower().rstrip(".")


def _is_loopback(host: str) -> bool:
    key = _host_key(host)
    if key == "localhost":
        return True
    try:
        return ipaddress.ip_address(key).is_loopback
    except ValueError:
        return False


def format_peer(host: str, port: int) -> str:
    """``host:port``, with IPv6 literals bracketed."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_peer(text: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> (host, port); raises ValueError."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"expected 'host:port', got {quote(text)}")
    text = text.strip()
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ValueError(f"expected '[address]:port', got {text!r}")
        port_text = rest[1:]
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep or ":" in host:
            raise ValueError(f"expected 'host:port' (IPv6 as '[address]:port'), got {text!r}")
    if not host or len(host) > MAX_HOST_CHARS or any(c.isspace() for c in host) or not host.isprintable():
        raise ValueError(f"bad host in {text!r}")
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"bad port in {text!r}: expected 1..65535")
    return host, int(port_text)


class AllowedPeers:
    """The prefill listeners a decode engine may fetch from.

    Each entry is a prefill instance's ``host:port`` as it advertises it (its
    ``host`` and ``port`` settings: TP rank 0's listener; rank r's worker
    dials port + r of the same entry). With no entries, only loopback hosts
    (127.0.0.0/8, ::1, ``localhost``) are allowed, on any port: enough for
    a pair started by hand on one machine, and never another machine.
    """

    def __init__(self, entries: Iterable[tuple[str, int]] = ()):
        self.entries: tuple[tuple[str, int], ...] = tuple(entries)
        self._keys = frozenset((_host_key(h), p) for h, p in self.entries)

    @classmethod
    def parse(cls, raw: Any) -> AllowedPeers:
        """From a list of ``"host:port"`` strings or one comma-separated string; raises ValueError."""
        if raw is None or raw == "":
            return cls()
        if isinstance(raw, str):
            items: list[Any] = [p for p in raw.split(",") if p.strip()]
        elif isinstance(raw, (list, tuple)):
            items = list(raw)
        else:
            raise ValueError(f"expected a list of 'host:port' strings, got {quote(raw)}")
        return cls(parse_peer(item) for item in items)

    @property
    def configured(self) -> bool:
        return bool(self.entries)

    def allows(self, host: str, port: int) -> bool:
        if not self.entries:
            return _is_loopback(host)
        return (_host_key(host), port) in self._keys

    def __str__(self) -> str:
        if not self.entries:
            return "loopback only (no peers configured)"
        return ", ".join(format_peer(h, p) for h, p in self.entries)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AllowedPeers) and self._keys == other._keys

    def __hash__(self) -> int:
        return hash(self._keys)

    def __repr__(self) -> str:
        return f"AllowedPeers({[format_peer(h, p) for h, p in self.entries]!r})"


def _flag(params: Mapping[str, Any], key: str) -> bool | Declined:
    """A boolean flag: absent or null is False; anything but a JSON bool is declined."""
    value = params.get(key)
    if value is None:
        return False
    if isinstance(value, bool):
        return value
    return Declined(key, f"must be true or false, got {quote(value)}")


def check_remote_prefill(params: Any, *, num_prompt_tokens: int, block_size: int,
                         peers: AllowedPeers) -> RemotePrefill | Declined | None:
    """Decode side: None for a request that is not a remote prefill, else its validated form.

    ``num_prompt_tokens`` is this engine's prompt length for the request,
    ``block_size`` its KV block size (the prefill engine's layout must match
    it, or the fetch fails). Never raises.
    """
    if params is None:
        return None
    if not isinstance(params, Mapping):
        return Declined("kv_transfer_params", f"must be a JSON object, got {type(params).__name__}")
    flag = _flag(params, "do_remote_prefill")
    if isinstance(flag, Declined) or not flag:
        return flag or None
    decode = _flag(params, "do_remote_decode")
    if isinstance(decode, Declined):
        return decode
    if decode:
        return Declined("do_remote_decode", "is true together with do_remote_prefill")
    transfer = params.get("transfer")
    if transfer is not None and transfer != TRANSFER_NAME:
        return Declined("transfer", f"must be {TRANSFER_NAME!r}, got {quote(transfer)}")

    key = stream_key_of(params)
    if isinstance(key, Declined):
        return key
    request_id = params.get("remote_request_id", key)  # a streamed transfer names the request by its key
    if not is_request_id(request_id):
        return Declined("remote_request_id", f"must be 1..{MAX_REQUEST_ID_CHARS} printable ASCII characters "
                                             f"without spaces, got {quote(request_id)}")
    engine_id = params.get("remote_engine_id")
    if engine_id is not None and not _clean_str(engine_id, MAX_ENGINE_ID_CHARS):
        return Declined("remote_engine_id", f"must be null or a printable string of 1..{MAX_ENGINE_ID_CHARS} "
                                            f"characters, got {quote(engine_id)}")
    host = params.get("remote_host")
    if not _clean_str(host, MAX_HOST_CHARS) or any(c.isspace() for c in host):
        return Declined("remote_host", f"must be a host name or address, got {quote(host)}")
    port = params.get("remote_port")
    if not is_int(port) or not 1 <= port <= 65535:
        return Declined("remote_port", f"must be an integer in 1..65535, got {quote(port)}")
    tp_size = params.get("tp_size", 1)
    if tp_size is None:
        tp_size = 1
    if not is_int(tp_size) or not 1 <= tp_size <= MAX_TP_SIZE:
        return Declined("tp_size", f"must be an integer in 1..{MAX_TP_SIZE}, got {quote(tp_size)}")
    if port + tp_size - 1 > 65535:
        return Declined("tp_size", f"{tp_size} ranks from port {port} run past 65535")
    if not peers.allows(host, port):
        return Declined("remote_host", f"{quote(format_peer(host, port))} is not an allowed prefill peer "
                                       f"({peers})")
    lease = params.get("lease_s")
    if lease is not None and (isinstance(lease, bool) or not isinstance(lease, (int, float))
                              or not math.isfinite(lease) or not 0 < lease <= MAX_LEASE_S):
        return Declined("lease_s", f"must be a number of seconds in (0, {MAX_LEASE_S:g}], got {quote(lease)}")

    if key is not None:
        # Streamed: P's blocks are its own business; both sides count the whole prompt.
        if params.get("remote_block_ids") is not None:
            return Declined("remote_block_ids", "must be absent in a streamed transfer (stream_key is set)")
        num_tokens = params.get("remote_num_tokens", num_prompt_tokens)
        if not is_int(num_tokens) or num_tokens != num_prompt_tokens:
            return Declined("remote_num_tokens", f"must be the prompt's {num_prompt_tokens} tokens in a streamed "
                                                 f"transfer, got {quote(num_tokens)}")
        return RemotePrefill(request_id=request_id, host=host, port=port, block_ids=(), num_tokens=num_tokens,
                             tp_size=tp_size, engine_id=engine_id, stream_key=key)
    num_tokens = params.get("remote_num_tokens")
    if num_tokens is None:
        num_tokens = num_prompt_tokens
    if not is_int(num_tokens) or not 1 <= num_tokens <= num_prompt_tokens:
        return Declined("remote_num_tokens", f"must be an integer in 1..{num_prompt_tokens} (the prompt), "
                                             f"got {quote(num_tokens)}")
    block_ids = params.get("remote_block_ids")
    if not isinstance(block_ids, (list, tuple)):
        return Declined("remote_block_ids", f"must be a list of block ids, got {quote(block_ids)}")
    # The prefill side sends exactly the blocks of its computed tokens
    # (vLLM's get_block_ids_for_computed_tokens): ceil(tokens / block_size).
    want = -(-num_tokens // max(1, block_size))
    if len(block_ids) != want:
        return Declined("remote_block_ids", f"has {len(block_ids)} entries, {num_tokens} tokens in blocks of "
                                            f"{block_size} need {want}")
    for b in block_ids:
        if not is_int(b) or not 0 <= b <= MAX_BLOCK_ID:
            return Declined("remote_block_ids", f"entries must be integers in 0..{MAX_BLOCK_ID}, got {quote(b)}")
    if len(set(block_ids)) != len(block_ids):
        return Declined("remote_block_ids", "repeats a block id")
    return RemotePrefill(request_id=request_id, host=host, port=port, block_ids=tuple(block_ids),
                         num_tokens=num_tokens, tp_size=tp_size, engine_id=engine_id)


def check_remote_decode(params: Any) -> bool | Declined:
    """Prefill side: True when the request asks to keep its KV for a decode engine. Never raises."""
    if params is None:
        return False
    if not isinstance(params, Mapping):
        return Declined("kv_transfer_params", f"must be a JSON object, got {type(params).__name__}")
    flag = _flag(params, "do_remote_decode")
    if isinstance(flag, Declined) or not flag:
        return flag
    prefill = _flag(params, "do_remote_prefill")
    if isinstance(prefill, Declined):
        return prefill
    if prefill:
        return Declined("do_remote_prefill", "is true together with do_remote_decode")
    return True
