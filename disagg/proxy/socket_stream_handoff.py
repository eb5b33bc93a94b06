"""vLLM with our socket KV connector in streaming mode: prefill and decode at once.

The proxy (:func:`disagg.proxy.app._open_reply`) calls :meth:`SocketStreamHandoff.serve`
once per ``split`` route when it runs with ``--handoff vllm-socket-stream``;
``disagg up`` chooses it for vLLM topologies with
``connector: {type: socket, streaming: true}`` (:mod:`disagg.launch.frontend`).

Protocol, per route: a fresh random transfer key ``K`` (:func:`new_stream_key`)
joins the two requests, which are sent at the same time.

- Prefill (P) gets :meth:`VllmHandoff.prefill_body` (one token, not streamed,
  ``n: 1``) with ``kv_transfer_params = {"do_remote_decode": true,
  "do_remote_prefill": false, "stream_key": K}``. Its reply is read and
  dropped (its time and prompt token count go to the route's learner and
  ``prefill_seconds``, as for :class:`VllmHandoff`).
- Decode (D) gets the client's request with ``kv_transfer_params =
  {"do_remote_prefill": true, "do_remote_decode": false, "transfer": "socket",
  "stream_key": K, "remote_host": H, "remote_port": PORT}``, ``H:PORT`` being
  the KV listener of the prefill instance chosen for the route (TP rank 0's).
  D's connector connects there with ``K`` and receives each layer's KV while
  P is still computing. The client gets D's reply.

Failure behaviour: :mod:`disagg.proxy.concurrent_handoff` (the machinery both
concurrent vLLM handoffs share). D's connector recomputes a prompt whose KV it
cannot get (``kv_load_failure_policy`` recompute), so D's answer is always
correct and the client only ever gets one engine's answer: a prefill failing
after D answered leaves D alone; D refusing the connection sends the same
request to the next healthy decode instance (the key lets any decode engine
connect).

Option (``--handoff-option``): ``kv_peers=H1:P1,H2:P2``, the KV listener of each
``--prefill`` URL, in the same order (IPv6 as ``[addr]:port``).
"""

from __future__ import annotations

import ipaddress
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from disagg.errors import ProxyError
from disagg.proxy.backends import Backend, BackendPool
from disagg.proxy.concurrent_handoff import ConcurrentVllmHandoff, Dispatch
from disagg.proxy.metrics import ProxyMetrics
from disagg.proxy.routes import PromptRoute
from disagg.proxy.upstream import Upstream
from disagg.serving import KV_PEERS, STREAMING_HANDOFF

#: the ``kv_transfer_params`` field naming a streamed transfer (prefill's and decode's)
STREAM_KEY = "stream_key"
#: ``transfer`` in decode's ``kv_transfer_params``: the socket connector's name for its transfers
TRANSFER = "socket"

_HOST_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?")
_PORT_RE = re.compile(r"[0-9]{1,5}")


def new_stream_key() -> str:
    """A fresh transfer key for one route (192 random bits, URL-safe text)."""
    return secrets.token_urlsafe(24)


@dataclass(frozen=True)
class KvPeer:
    """One prefill instance's KV listener (TP rank 0's)."""

    host: str
    port: int


def parse_kv_peers(prefill_urls: tuple[str, ...], option: str | None) -> dict[str, KvPeer]:
    """Prefill URL -> :class:`KvPeer` from ``kv_peers=H1:P1,H2:P2`` (one per URL, in order)."""
    usage = ("--handoff-option kv_peers=HOST:PORT,... (each --prefill URL's KV listener, in order; "
             "IPv6 as [ADDR]:PORT)")
    if not option:
        raise ProxyError(f"handoff vllm-socket-stream needs the prefill instances' KV listeners: {usage}")
    peers = [_kv_peer(entry, option, usage) for entry in option.split(",")]
    if len(peers) != len(prefill_urls):
        raise ProxyError(f"kv_peers={option!r} has {len(peers)} entries for {len(prefill_urls)} prefill URLs "
                         "(each prefill instance has its own listener); expected " + usage)
    seen = {p for i, p in enumerate(peers) if p in peers[:i]}
    if seen:
        dup = next(iter(seen))
        raise ProxyError(f"kv_peers={option!r} names {dup.host}:{dup.port} twice (each prefill instance has "
                         "its own listener)")
    return dict(zip(prefill_urls, peers, strict=True))


def _kv_peer(entry: str, option: str, usage: str) -> KvPeer:
    bad = f"kv_peers={option!r}: entry {entry!r}"
    bracketed = entry.startswith("[")
    host, sep, port = entry[1:].partition("]:") if bracketed else entry.rpartition(":")
    if not sep:
        raise ProxyError(f"{bad}: expected HOST:PORT or [IPV6]:PORT; {usage}")
    if bracketed:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ProxyError(f"{bad}: {host!r} in brackets is not an IPv6 address; {usage}") from None
    elif ":" in host:
        raise ProxyError(f"{bad}: an IPv6 address goes in brackets, [ADDR]:PORT")
    elif not _HOST_RE.fullmatch(host):
        raise ProxyError(f"{bad}: expected HOST:PORT with a host name or IPv4 address; {usage}")
    if not _PORT_RE.fullmatch(port) or not 0 < int(port) < 65536:
        raise ProxyError(f"{bad}: expected a port number in 1..65535 after the ':'; {usage}")
    return KvPeer(host, int(port))


class SocketStreamHandoff(ConcurrentVllmHandoff):
    """vLLM with the socket connector streaming KV: prefill and decode in parallel, joined by a key."""

    kind = STREAMING_HANDOFF

    def __init__(self, upstream: Upstream, prefill: BackendPool, decode: BackendPool,
                 metrics: ProxyMetrics, options: Mapping[str, str] | None = None) -> None:
        super().__init__(upstream, prefill, decode, metrics, options)
        self.peers = parse_kv_peers(tuple(b.url for b in prefill.backends), self.options.get(KV_PEERS))

    @staticmethod
    def prefill_params(key: str) -> dict[str, Any]:
        """The ``kv_transfer_params`` prefill receives."""
        return {"do_remote_decode": True, "do_remote_prefill": False, STREAM_KEY: key}

    @staticmethod
    def decode_params(key: str, peer: KvPeer) -> dict[str, Any]:
        """The ``kv_transfer_params`` decode receives: where to fetch the KV, and the key."""
        return {"do_remote_prefill": True, "do_remote_decode": False, "transfer": TRANSFER, STREAM_KEY: key,
                "remote_host": peer.host, "remote_port": peer.port}

    def dispatch(self, route: PromptRoute, prefill: Backend) -> Dispatch:
        """A fresh key for both sides; decode fetches from ``prefill``'s KV listener."""
        key = new_stream_key()
        return Dispatch(self.prefill_params(key), self.decode_params(key, self.peers[prefill.url]),
                        route.request.headers)
