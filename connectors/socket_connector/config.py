"""Settings of the socket KV connector, from ``kv_connector_extra_config`` and env.

Keys of ``kv_connector_extra_config`` (all optional):

- ``host``: address the prefill listener binds to and advertises (the host's
  link address); env ``DISAGG_KV_HOST``; default 127.0.0.1.
- ``port``: listener port of TP rank 0 (rank r listens on port + r); env
  ``DISAGG_KV_PORT``; required on a producer.
- ``secret_env``: name of the env var holding the shared secret (default
  ``DISAGG_KV_SECRET``). The secret itself never goes in the config, which
  vLLM logs.
- ``kv_lease_duration`` (or ``lease_s``): seconds the prefill side keeps a
  finished request's blocks for the decode side (default 30).
- ``streams``: parallel TCP connections per fetch (default 2).
- ``blocks_per_message``: blocks per message of a fetch (default 64; with
  ``wire_format: fp8`` as many of the largest layer's blocks as fit in 4 MiB
  on the wire, at least one and at most 64, so that converting one message
  overlaps sending another).
- ``io_timeout_s``, ``connect_timeout_s``: socket timeouts (30 s, 5 s).
- ``registration_wait_s``: how long the listener waits for a lease it does
  not know yet before refusing the fetch (5 s).
- ``stream_wait_s``: how long the listener waits for a streamed request to be
  scheduled on the prefill engine before refusing the decode engine's stream
  (default 20; keep it below ``io_timeout_s``, which bounds the decode side's
  wait for the answer).
- ``max_parallel_streams``: streamed transfers received at once on the decode
  side (default 16; each waits for its remote prefill, mostly idle).
- ``max_parallel_fetches``: requests fetched at once on the decode side (4).
- ``gil_switch_interval_ms``: the engine worker's ``sys.setswitchinterval``
  (default 0.5; 0 leaves Python's 5 ms). While a request waits for its KV,
  the engine's loop keeps the GIL busy; each return of a transfer thread from
  a system call then waits up to this long for the GIL.
- ``idle_wait_ms``: on a step that scheduled no tokens while this worker has
  transfers in flight, wait up to this long for one to end before handing the
  step back (default 2; 0 = return at once). vLLM steps an engine that only
  waits for KV in a tight loop, which takes the CPU and the GIL from the
  transfer threads; the cost is that a request arriving meanwhile is seen up
  to this much later.
- ``peers``: the prefill listeners this decode engine may fetch from, as a
  list of ``"host:port"`` strings (``"[v6]:port"``) or one comma-separated
  string; env ``DISAGG_KV_PEERS``. Each is a prefill instance's ``host`` and
  ``port`` as it advertises them (TP rank r dials port + r of the entry).
  ``disagg`` fills it in for decode instances. Without it only loopback
  hosts are allowed, on any port: a pair started by hand on one machine
  works, and a request naming any other host is declined (computed locally).
- ``max_pending_handshakes``: connections the prefill listener holds before
  they authenticate, from all peers together (default 64); more are closed
  as soon as they are accepted.
- ``max_pending_handshakes_per_source``: the same from one source address
  (an IPv4 address, or an IPv6 address's /64; default 4): idle strangers on
  one address cannot take the slots the decode engines' addresses need. A
  decode engine whose connection is closed that way retries it (client.py).
- ``allowed_peers``: the addresses the prefill listener accepts connections
  from, as a list of IP addresses or host names (or one comma-separated
  string); host names are resolved once, when the listener starts. A
  connection from any other address is closed as soon as it is accepted,
  before any thread or handshake (counted in ``num_refused_peers``). Unset or
  empty: any address may try to authenticate. ``disagg`` fills it in for
  prefill instances with the decode hosts' addresses when they are IP
  addresses.
- ``handshake_timeout_s``: the whole authentication exchange must finish in
  this long or ``io_timeout_s``, whichever is shorter (default 5), however
  the peer spreads its bytes.
- ``wire_format``: ``raw`` (default: the cache's own bytes) or ``fp8`` (float8
  e4m3 with a scale per 128 elements: about half a bf16 cache's bytes, lossy;
  see wireformat.py). Both engines of a pair must say the same: the hello's
  layout check refuses a mismatch.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .auth import check_secret
from .params import MAX_LEASE_S, AllowedPeers

#: ``wire_format`` values (encoded by wireformat.py; kept here, with the fp8 format's sizes, so that
#: reading settings and sizing transfers (``disagg plan``) need no torch)
WIRE_FORMATS = ("raw", "fp8")
#: blocks per message of a fetch when neither side names a number (raw wire format; fp8: wireformat.py)
BLOCKS_PER_MESSAGE = 64
#: fp8: elements sharing one scale, and the bytes of one scale (float32)
FP8_GROUP = 128
FP8_SCALE_BYTES = 4


def wire_ratio(wire: str, element_bytes: int) -> float:
    """Bytes on the wire per byte of KV cache whose elements take ``element_bytes``, for segments
    of whole scale groups (every real attention layout); raises ValueError for an unknown format or
    fp8 over a cache that is not wider than fp8."""
    if wire == "raw":
        return 1.0
    if wire != "fp8":
        raise ValueError(f"unknown wire format {wire!r}; expected one of {', '.join(WIRE_FORMATS)}")
    if element_bytes < 2:
        raise ValueError("wire_format fp8 needs a KV cache of 2 or 4 bytes per element (bf16, fp16, fp32)")
    return (1 + FP8_SCALE_BYTES / FP8_GROUP) / element_bytes

DEFAULT_SECRET_ENV = "DISAGG_KV_SECRET"
#: connections the prefill listener lets authenticate at once: from all peers, and from one source
#: address (``max_pending_handshakes``, ``max_pending_handshakes_per_source``)
MAX_PENDING_HANDSHAKES = 64
MAX_PENDING_HANDSHAKES_PER_SOURCE = 4
#: most ``allowed_peers`` entries accepted
MAX_ALLOWED_PEERS = 256
_HOST_LABEL_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-")


def parse_allowed_peers(raw: Any) -> tuple[str, ...]:
    """``allowed_peers`` as IP addresses and host names (syntax only: names are resolved by the
    listener when it starts, ``server.resolve_peers``); raises ConfigError naming a bad entry."""
    if raw is None or raw == "" or raw == []:
        return ()
    if isinstance(raw, str):
        items: list[Any] = [item.strip() for item in raw.split(",") if item.strip()]
    elif isinstance(raw, (list, tuple)):
        items = list(raw)
    else:
        raise ConfigError(f"kv_connector_extra_config.allowed_peers: expected a list of addresses or host names, "
                          f"got {type(raw).__name__}")
    if len(items) > MAX_ALLOWED_PEERS:
        raise ConfigError(f"kv_connector_extra_config.allowed_peers: {len(items)} entries, at most "
                          f"{MAX_ALLOWED_PEERS}")
    out: list[str] = []
    for item in items:
        if not _is_address_or_host(item):
            raise ConfigError(f"kv_connector_extra_config.allowed_peers: {item!r:.80} is not an IP address or "
                              "host name")
        if item not in out:
            out.append(item)
    return tuple(out)


def _is_address_or_host(item: object) -> bool:
    if not isinstance(item, str) or not item or len(item) > 253:
        return False
    try:
        ipaddress.ip_address(item)
        return True
    except ValueError:
        pass
    labels = item.lower().removesuffix(".").split(".")
    return all(0 < len(label) <= 63 and _HOST_LABEL_CHARS.issuperset(label) and not label.startswith("-")
               and not label.endswith("-") for label in labels)


class ConfigError(ValueError):
    """A missing or invalid connector setting; the message names the key."""


@dataclass(frozen=True)
class SocketSettings:
    """Everything the connector reads from its configuration, validated once."""

    host: str
    port: int | None
    secret: bytes
    lease_s: float = 30.0
    streams: int = 2
    blocks_per_message: int | None = None       # None: the wire format's default (wireformat.py)
    io_timeout_s: float = 30.0
    connect_timeout_s: float = 5.0
    registration_wait_s: float = 5.0
    stream_wait_s: float = 20.0
    max_parallel_fetches: int = 4
    max_parallel_streams: int = 16
    gil_switch_interval_ms: float = 0.5
    idle_wait_ms: float = 2.0
    peers: AllowedPeers = field(default_factory=AllowedPeers)
    max_pending_handshakes: int = MAX_PENDING_HANDSHAKES
    max_pending_handshakes_per_source: int = MAX_PENDING_HANDSHAKES_PER_SOURCE
    allowed_peers: tuple[str, ...] = ()
    handshake_timeout_s: float = 5.0
    wire_format: str = "raw"

    @classmethod
    def load(cls, extra: Mapping[str, Any] | None, env: Mapping[str, str] = os.environ,
             need_port: bool = False) -> SocketSettings:
        """Build settings from the extra config and environment; raises ConfigError."""
        extra = dict(extra or {})

        def num(key: str, default: float, cast: type = float, minimum: float = 0,
                maximum: float | None = None) -> Any:
            raw = extra.get(key, default)
            try:
                value = cast(raw)
            except (TypeError, ValueError, OverflowError):
                raise ConfigError(f"kv_connector_extra_config.{key}: expected a number, got {raw!r}") from None
            if not value >= minimum:  # also refuses NaN
                raise ConfigError(f"kv_connector_extra_config.{key}: must be >= {minimum}, got {value}")
            if maximum is not None and value > maximum:
                raise ConfigError(f"kv_connector_extra_config.{key}: must be <= {maximum:g}, got {value}")
            return value

        secret_env = str(extra.get("secret_env", DEFAULT_SECRET_ENV))
        raw_secret = env.get(secret_env, "")
        if not raw_secret:
            raise ConfigError(
                f"the socket KV connector needs a shared secret in env {secret_env} "
                "(`disagg up` generates one per topology)"
            )
        try:
            secret = check_secret(raw_secret.encode())
        except ValueError as exc:
            raise ConfigError(f"env {secret_env}: {exc}") from None
        host = str(extra.get("host") or env.get("DISAGG_KV_HOST") or "127.0.0.1")
        port_raw = extra.get("port", env.get("DISAGG_KV_PORT"))
        port: int | None = None
        if port_raw not in (None, ""):
            try:
                port = int(port_raw)
            except (TypeError, ValueError):
                raise ConfigError(f"kv_connector_extra_config.port: expected an integer, got {port_raw!r}") from None
            if not 0 <= port < 65536:
                raise ConfigError(f"kv_connector_extra_config.port: {port} is not a TCP port")
        if need_port and port is None:
            raise ConfigError("the socket KV connector's producer needs kv_connector_extra_config.port "
                              "or env DISAGG_KV_PORT")
        lease_key = "lease_s" if "lease_s" in extra else "kv_lease_duration"
        try:
            peers = AllowedPeers.parse(extra.get("peers", env.get("DISAGG_KV_PEERS")))
        except ValueError as exc:
            raise ConfigError(f"kv_connector_extra_config.peers: {exc}") from None
        wire_format = str(extra.get("wire_format", "raw"))
        if wire_format not in WIRE_FORMATS:
            raise ConfigError(f"kv_connector_extra_config.wire_format: expected one of {', '.join(WIRE_FORMATS)}, "
                              f"got {extra.get('wire_format')!r:.40}")
        return cls(
            host=host,
            port=port,
            secret=secret,
            lease_s=num(lease_key, 30.0, minimum=0.1, maximum=MAX_LEASE_S),
            streams=num("streams", 2, int, 1),
            blocks_per_message=None if extra.get("blocks_per_message") is None
            else num("blocks_per_message", BLOCKS_PER_MESSAGE, int, 1),
            io_timeout_s=num("io_timeout_s", 30.0, minimum=0.1),
            connect_timeout_s=num("connect_timeout_s", 5.0, minimum=0.1),
            registration_wait_s=num("registration_wait_s", 5.0),
            stream_wait_s=num("stream_wait_s", 20.0),
            max_parallel_fetches=num("max_parallel_fetches", 4, int, 1),
            max_parallel_streams=num("max_parallel_streams", 16, int, 1),
            gil_switch_interval_ms=num("gil_switch_interval_ms", 0.5),
            idle_wait_ms=num("idle_wait_ms", 2.0),
            peers=peers,
            max_pending_handshakes=num("max_pending_handshakes", MAX_PENDING_HANDSHAKES, int, 1),
            max_pending_handshakes_per_source=num("max_pending_handshakes_per_source",
                                                  MAX_PENDING_HANDSHAKES_PER_SOURCE, int, 1),
            allowed_peers=parse_allowed_peers(extra.get("allowed_peers")),
            handshake_timeout_s=num("handshake_timeout_s", 5.0, minimum=0.1),
            wire_format=wire_format,
        )
