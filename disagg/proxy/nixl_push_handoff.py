"""vLLM with NIXL in push mode (``NixlPushConnector``): prefill and decode at once.

The proxy (:func:`disagg.proxy.app._open_reply`) calls :meth:`NixlPushHandoff.serve`
once per ``split`` route when it runs with ``--handoff vllm-nixl-push``; ``disagg up``
chooses it for vLLM topologies with ``connector: nixl-push``
(:mod:`disagg.launch.frontend`, :class:`disagg.kv.nixl.NixlPushVllmAdapter`).

What vLLM 0.32's push connector needs (``kv_connector/v1/nixl/push_scheduler.py``,
``push_worker.py``): D, once it allocated blocks for a request whose
``kv_transfer_params`` say ``do_remote_prefill``, sends P a registration (its own
engine id, side channel and block ids) over NIXL, addressed with the request's
``remote_engine_id``, ``remote_host``, ``remote_port`` (P's side channel) and
``tp_size`` (P's); P, when a request with ``do_remote_decode`` finishes, WRITEs its KV
into the blocks of the registration whose request id matches its own less vLLM's
random ``-xxxxxxxx`` suffix (``get_base_request_id``), and D decodes once the WRITE's
notification arrived. So D must get P's coordinates before P answers, and both
engines must see one request id that no other request ever had.

Protocol, per route:

- Both requests carry ``X-Request-Id: <id>-push<16 hex>`` (:func:`push_request_id`),
  fresh per route: vLLM matches a registration to a prefill by that id alone, so a
  client reusing an ``X-Request-Id`` (a retry, a constant header) must never make P
  WRITE one request's KV into another's blocks. vLLM puts it in the reply's ``id``
  (``cmpl-<id>-push...``); the relay removes the suffix again
  (:attr:`DecodeReply.id_suffix`), so the client reads ``cmpl-<id>`` as from a colocated
  server. Batches are re-numbered by the proxy anyway.
- Prefill (P) gets :meth:`VllmHandoff.prefill_body` with ``kv_transfer_params =
  {"do_remote_decode": true, "do_remote_prefill": false}``.
- Decode (D) gets the client's request with ``kv_transfer_params =
  {"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": E,
  "remote_host": H, "remote_port": PORT, "tp_size": T, "pp_size": PP, "dcp_size":
  DCP, "remote_request_id": null, "remote_block_ids": null}`` (:meth:`NixlPushHandoff.decode_params`):
  P's NIXL engine id, side channel and parallel sizes. ``remote_request_id`` must be
  present (D's scheduler reads the key); null sends no lease heartbeats, which P's
  30 s lease does not need, as D registers while P computes.
- P's coordinates are what P reported in its last reply (every push-mode reply
  carries them: ``remote_engine_id``, ``remote_host``, ``remote_port``, ``tp_size``,
  ``transfer_mode: "push"``), so the proxy needs no options: vLLM draws an engine's id
  at each start. Until a prefill engine has answered once, and again after it came
  back into service (:meth:`BackendPool.on_return`: a restart is a new engine id), its
  routes go in turn, as :class:`VllmHandoff` does: P first, then D with P's reply
  unchanged (P keeps the finished blocks for a registration up to its lease).
- Decode's reply is held until P answered (``hold_decode``): D can decode nothing
  before P's WRITE, which follows P's finish, so this costs nothing, and every P
  failure then comes before the client saw anything. P's 4xx reaches the client as P
  answered; any other P failure closes D's request and the fallback applies (decode
  alone, or 503 with ``never``), as for the other concurrent handoff
  (:mod:`disagg.proxy.concurrent_handoff`, where the rest of the failure rules are).
- A P reply whose engine id is not the one D was given (P restarted before the
  proxy saw it go) is such a failure, ``peer_changed``: D registered with an engine
  that is gone and would wait for ever. The reply's coordinates are kept for the
  next route. A P reply that is not push mode's (no ``kv_transfer_params``, or
  ``transfer_mode`` not ``push``) is ``no_kv_params``.

What vLLM 0.32 leaves behind (not the proxy's to fix): a D request closed while it
waits for a WRITE that never comes (P failed after D registered) keeps its KV blocks
in D, as the scheduler frees such blocks only when the transfer reports back; the
push scheduler's registration watchdog only drops the registration. P keeps such a
registration too (it is never matched: the request id was fresh).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

from multidict import CIMultiDict

from disagg.proxy.backends import Backend, BackendPool
from disagg.proxy.concurrent_handoff import ConcurrentVllmHandoff, Dispatch
from disagg.proxy.handoff import DecodeReply, PrefillFailed
from disagg.proxy.headers import REQUEST_ID
from disagg.proxy.metrics import ProxyMetrics
from disagg.proxy.routes import PromptRoute
from disagg.proxy.upstream import Upstream
from disagg.serving import NIXL_PUSH_HANDOFF

log = logging.getLogger("disagg.proxy")

#: ``transfer_mode`` in a NixlPushConnector prefill engine's ``kv_transfer_params``
PUSH_MODE = "push"


def push_suffix() -> str:
    """A fresh ``-push<16 hex>`` (64 random bits; never 8 hex alone, which vLLM would strip as its
    own suffix) for one route's request id."""
    return f"-push{secrets.token_hex(8)}"


def push_request_id(request_id: str) -> str:
    """The ``X-Request-Id`` both engines get for one route: ``request_id`` plus :func:`push_suffix`."""
    return request_id + push_suffix()


@dataclass(frozen=True)
class PushPeer:
    """A prefill engine's NIXL coordinates, as it reports them in its replies."""

    engine_id: str
    host: str
    port: int
    tp_size: int
    pp_size: int = 1
    dcp_size: int = 1

    @classmethod
    def from_params(cls, params: object) -> PushPeer | None:
        """The coordinates in a push-mode prefill reply's ``kv_transfer_params``, or None when
        ``params`` is not one (missing fields, wrong types, ``transfer_mode`` not ``push``)."""
        if not isinstance(params, dict) or params.get("transfer_mode") != PUSH_MODE:
            return None
        engine_id, host, port = params.get("remote_engine_id"), params.get("remote_host"), params.get("remote_port")
        sizes = [params.get(key, 1) for key in ("tp_size", "pp_size", "dcp_size")]
        if not (isinstance(engine_id, str) and engine_id and isinstance(host, str) and host
                and type(port) is int and 0 < port < 65536 and all(type(n) is int and n >= 1 for n in sizes)):
            return None
        return cls(engine_id, host, port, *sizes)


class NixlPushHandoff(ConcurrentVllmHandoff):
    """vLLM with NixlPushConnector: decode registers its blocks while prefill computes, prefill
    WRITEs into them (see the module docstring)."""

    kind = NIXL_PUSH_HANDOFF
    hold_decode = True

    #: ``kv_transfer_params`` prefill receives
    PREFILL_PARAMS: ClassVar[dict[str, Any]] = {"do_remote_decode": True, "do_remote_prefill": False}

    def __init__(self, upstream: Upstream, prefill: BackendPool, decode: BackendPool,
                 metrics: ProxyMetrics, options: Mapping[str, str] | None = None) -> None:
        super().__init__(upstream, prefill, decode, metrics, options)
        #: prefill URL -> its coordinates, from its last reply
        self.peers: dict[str, PushPeer] = {}
        prefill.on_return(self._forget)

    def _forget(self, backend: Backend) -> None:
        """``backend`` came back into service: maybe a new process, with a new engine id."""
        if self.peers.pop(backend.url, None) is not None:
            log.info("prefill %s back in service: its next split goes in turn to learn its NIXL engine id",
                     backend.url)

    @staticmethod
    def decode_params(peer: PushPeer) -> dict[str, Any]:
        """The ``kv_transfer_params`` decode receives: where to register its blocks."""
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": peer.engine_id,
                "remote_host": peer.host, "remote_port": peer.port, "tp_size": peer.tp_size,
                "pp_size": peer.pp_size, "dcp_size": peer.dcp_size, "remote_request_id": None,
                "remote_block_ids": None}

    @staticmethod
    def engine_headers(route: PromptRoute) -> tuple[CIMultiDict[str], str]:
        """The route's headers with its request id plus a fresh :func:`push_suffix`, and that suffix
        (which the relay removes from the reply again: :attr:`DecodeReply.id_suffix`)."""
        suffix = push_suffix()
        headers = CIMultiDict(route.request.headers)
        headers[REQUEST_ID] = route.request.request_id + suffix
        return headers, suffix

    def dispatch(self, route: PromptRoute, prefill: Backend) -> Dispatch:
        headers, suffix = self.engine_headers(route)
        return Dispatch(dict(self.PREFILL_PARAMS), self.decode_params(self.peers[prefill.url]), headers, suffix)

    def learn(self, backend: Backend, params: object) -> PushPeer:
        """Record the coordinates ``backend`` reported in a reply's ``kv_transfer_params``; raises
        :class:`PrefillFailed` (``no_kv_params``) when the reply is not push mode's."""
        peer = PushPeer.from_params(params)
        if peer is None:
            self.peers.pop(backend.url, None)   # no longer push mode: its next split goes in turn
            raise PrefillFailed("no_kv_params", f"prefill {backend.url} answered without push-mode "
                                f"kv_transfer_params (is it started with NixlPushConnector?): {params!r:.300}")
        if self.peers.get(backend.url) != peer:
            log.info("prefill %s: NIXL engine %s, side channel %s:%d, tp %d", backend.url, peer.engine_id,
                     peer.host, peer.port, peer.tp_size)
            self.peers[backend.url] = peer
        return peer

    def check_prefill(self, route: PromptRoute, backend: Backend, reply: Mapping[str, Any]) -> None:
        """Learn ``backend``'s coordinates from its reply; the route fails (``peer_changed``) if
        decode was told another engine id."""
        peer = self.learn(backend, reply.get("kv_transfer_params"))
        told = (route.kv_transfer_params or {}).get("remote_engine_id")
        if told != peer.engine_id:
            raise PrefillFailed("peer_changed", f"prefill {backend.url} is NIXL engine {peer.engine_id} now, but "
                                f"decode registered with {told} (a restart the proxy had not seen)")

    async def run_prefill(self, route: PromptRoute, kv_transfer_params: Mapping[str, Any] | None = None,
                          headers: Mapping[str, str] | None = None) -> dict[str, Any]:
        """:meth:`VllmHandoff.run_prefill` (a route served in turn), learning P's coordinates."""
        params = await super().run_prefill(route, kv_transfer_params, headers)
        assert route.prefill is not None  # set by run_prefill
        self.learn(route.prefill, params)
        return params

    @asynccontextmanager
    async def serve(self, route: PromptRoute) -> AsyncIterator[DecodeReply]:
        """Both requests at once when the prefill engine's coordinates are known, else in turn."""
        p_backend = route.prefill = self.pick_prefill(route)
        if p_backend.url in self.peers:
            async with super().serve(route) as reply:
                yield reply
            return
        log.info("request %s: prefill %s's NIXL engine not known yet: prefill, then decode, in turn",
                 route.request.request_id, p_backend.url)
        headers, suffix = self.engine_headers(route)
        async with self.serve_in_turn(route, self.PREFILL_PARAMS, headers) as reply:
            reply.id_suffix = suffix
            yield reply
