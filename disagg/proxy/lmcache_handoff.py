"""vLLM with LMCache in P/D mode (``LMCacheConnectorV1``): the handoff of
LMCache's ``examples/disagg_prefill/disagg_proxy_server.py``.

1. The proxy picks the decode instance first: prefill must know where to push.
2. The proxy registers the request id it is about to give prefill with its
   notice socket (:meth:`KvNotices.expect`), then sends prefill the client's
   request computing one token (as for NIXL) with
   ``kv_transfer_params = {"ret_first_tok": true, "disagg_spec": {req_id,
   receiver_host, receiver_init_port[], receiver_alloc_port[]}}``; its LMCache
   sender writes the KV into that decode's receiver buffer over NIXL.
3. Each prefill TP rank then pushes a ``ProxyNotif{req_id}`` (msgpack) to the
   proxy's ZMQ PULL socket (``pd_proxy_host:pd_proxy_port`` in the sender's
   YAML); the proxy waits for one per decode TP rank. A notice may arrive
   before prefill's HTTP reply: the id is registered before prefill is sent.
4. Decode gets the client's request unchanged; its LMCache receiver finds the
   prompt's KV in its buffer. (LMCache's example proxy instead appends
   prefill's first token and asks decode for one token fewer; sending the
   original request yields the same greedy output and keeps chat requests
   chat requests.)

If prefill fails or no notification comes within the request timeout, the
request falls back to decode alone (:class:`PrefillFailed`), as for NIXL.

The notice socket takes no authentication (LMCache's sender has none), so it
keeps nothing it did not ask for: a notice whose id no prompt awaits, a
surplus one, or a malformed one (not msgpack, not a map with a string
``req_id``) is dropped at once and counted in
``disagg_proxy_lmcache_notices_dropped_total{reason}``; ZMQ disconnects a
peer that sends a message over :data:`MAX_NOTICE_BYTES`. The only table is
one small entry per prompt awaiting its notices, at most :data:`MAX_AWAITED`.

Options (``--handoff-option``): ``receivers=[{"host": H, "init": [I1, I2], "alloc": [A1, A2]}, ...]``
(JSON, one object per ``--decode`` URL, in order: the receiver host, its init
ports and alloc ports per TP rank) and ``notify=BIND_HOST:PORT`` (where the proxy listens for the
notifications: ``disagg up`` passes the proxy's address as the prefill hosts reach it,
:func:`disagg.kv.lmcache.notify_host`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager, suppress
from dataclasses import dataclass
from typing import Any

import msgspec
import prometheus_client
import zmq
import zmq.asyncio

from disagg.errors import ProxyError
from disagg.proxy.backends import BackendPool
from disagg.proxy.errors import NoHealthyBackend, UpstreamConnectError
from disagg.proxy.handoff import DecodeReply, PrefillFailed, VllmHandoff
from disagg.proxy.metrics import ProxyMetrics
from disagg.proxy.routes import PromptRoute
from disagg.proxy.upstream import Upstream, finish
from disagg.serving import LMCACHE_HANDOFF

log = logging.getLogger("disagg.proxy")

#: the largest message the notice socket accepts, bytes (``zmq.MAXMSGSIZE``): LMCache's
#: ``ProxyNotif`` for one of our ids is about 100 bytes; ZMQ disconnects a peer that sends more
MAX_NOTICE_BYTES = 1024
#: at most this many prompts await their notices at once; one more falls back to decode alone
#: (reason ``kv_notice_table_full``)
MAX_AWAITED = 4096
#: the client's request id is cut to this many characters inside the id prefill and LMCache see
CLIENT_ID_CHARS = 64
#: random hex digits that end each id (64 bits): a sender that cannot read the traffic cannot guess one
ID_RANDOM_HEX = 16
#: at most one warning about dropped notices per this many seconds (the metric counts every one)
DROP_LOG_INTERVAL_S = 10.0
#: why a notice was dropped: the ``reason`` label of ``disagg_proxy_lmcache_notices_dropped_total``
DROP_REASONS = ("unawaited", "surplus", "malformed")


@dataclass(frozen=True)
class Receiver:
    """One decode instance's LMCache receiver."""

    host: str
    init_ports: tuple[int, ...]
    alloc_ports: tuple[int, ...]


def parse_receivers(decode_urls: tuple[str, ...], option: str | None) -> dict[str, Receiver]:
    """Decode URL -> :class:`Receiver` from ``receivers=[{"host", "init", "alloc"}, ...]`` (JSON)."""
    usage = ('--handoff-option receivers=[{"host": HOST, "init": [PORT, ...], "alloc": [PORT, ...]}, ...] '
             "(one per --decode URL, ports per TP rank)")
    if not option:
        raise ProxyError(f"handoff vllm-lmcache needs the decode receivers: {usage}")
    try:
        items = json.loads(option)
    except ValueError:
        raise ProxyError(f"receivers is not JSON: {option!r}; expected {usage}") from None
    if not isinstance(items, list) or len(items) != len(decode_urls):
        count = len(items) if isinstance(items, list) else "no list of"
        raise ProxyError(f"receivers has {count} entries for {len(decode_urls)} decode URLs; expected {usage}")
    out = {}
    for url, item in zip(decode_urls, items, strict=True):
        if not (isinstance(item, dict) and set(item) == {"host", "init", "alloc"}
                and isinstance(item["host"], str) and item["host"]
                and all(isinstance(item[k], list) and item[k] and all(_port(p) for p in item[k])
                        for k in ("init", "alloc"))
                and len(item["init"]) == len(item["alloc"])):
            raise ProxyError(f"receivers item {json.dumps(item)}: expected a host and as many init ports as "
                             f"alloc ports (1-65535); {usage}")
        out[url] = Receiver(item["host"], tuple(item["init"]), tuple(item["alloc"]))
    return out


def _port(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value < 65536


def parse_bind(option: str | None) -> str:
    """``HOST:PORT`` -> the ZMQ endpoint ``tcp://HOST:PORT``."""
    host, sep, port = (option or "").rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ProxyError(f"notify={option!r}: expected HOST:PORT where the proxy receives LMCache's notices")
    return f"tcp://{host}:{port}"


class _Notice(msgspec.Struct):
    """What the proxy reads of LMCache's ``ProxyNotif`` (a tagged msgspec struct: its ``type``
    field is ignored)."""

    req_id: str


_DECODER = msgspec.msgpack.Decoder(_Notice)


class AwaitedNotices:
    """The notices one prompt waits for: made by :meth:`KvNotices.expect`, counted by the
    listener, awaited by :meth:`LmcacheHandoff.serve` through :meth:`wait`."""

    __slots__ = ("_arrived", "needed", "received")

    def __init__(self, needed: int) -> None:
        self.needed = needed
        self.received = 0
        self._arrived = asyncio.Event()

    def add(self) -> bool:
        """Count one notice (the listener calls it); False if all ``needed`` were already there."""
        if self.received >= self.needed:
            return False
        self.received += 1
        if self.received >= self.needed:
            self._arrived.set()
        return True

    async def wait(self, timeout: float) -> bool:
        """True once ``needed`` notices arrived (at once if they came before the call);
        False after ``timeout`` seconds."""
        try:
            async with asyncio.timeout(timeout):
                await self._arrived.wait()
            return True
        except TimeoutError:
            return False


class KvNotices:
    """The proxy's ZMQ PULL socket for LMCache's ``ProxyNotif`` messages.

    Made by :class:`LmcacheHandoff` (closed by its ``aclose``). Its listener task keeps a
    notice only for an id registered with :meth:`expect` and not yet complete; everything
    else is dropped at once, counted in :attr:`dropped` (and told to ``on_drop``, the
    handoff's metric) and reported in at most one warning per :data:`DROP_LOG_INTERVAL_S`.
    """

    def __init__(self, endpoint: str, on_drop: Callable[[str], None] | None = None,
                 max_awaited: int = MAX_AWAITED) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        try:
            self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_NOTICE_BYTES)
            self._sock.bind(endpoint)
        except zmq.ZMQError as exc:
            self._sock.close(linger=0)
            self._ctx.term()
            raise ProxyError(f"cannot listen for LMCache notices on {endpoint}: {exc}") from None
        self.endpoint = endpoint
        self.max_awaited = max_awaited
        #: notices dropped since the start, by reason (:data:`DROP_REASONS`)
        self.dropped: Counter[str] = Counter()
        self._awaited: dict[str, AwaitedNotices] = {}
        self._on_drop = on_drop
        self._unreported: Counter[str] = Counter()
        self._next_report = 0.0
        self._task = asyncio.create_task(self._run(), name="disagg-lmcache-notices")

    @property
    def awaited(self) -> int:
        """How many prompts await notices now (the size of the only table the socket fills)."""
        return len(self._awaited)

    @contextmanager
    def expect(self, req_id: str, count: int) -> Iterator[AwaitedNotices]:
        """Await ``count`` notices for ``req_id`` while the block runs; notices for it are kept
        from the moment of the call (enter it before prefill is sent). :meth:`LmcacheHandoff.serve`
        calls it. Raises :class:`PrefillFailed` (``kv_notice_table_full``) when
        ``max_awaited`` prompts already await theirs."""
        if req_id in self._awaited:
            raise ValueError(f"LMCache notices for {req_id} are already awaited")
        if len(self._awaited) >= self.max_awaited:
            raise PrefillFailed("kv_notice_table_full", f"{len(self._awaited)} prompts already await LMCache "
                                f"notices (at most {self.max_awaited})")
        entry = self._awaited[req_id] = AwaitedNotices(count)
        try:
            yield entry
        finally:
            del self._awaited[req_id]

    async def _run(self) -> None:
        """The listener task (started by ``__init__``, cancelled by :meth:`aclose`): read each
        message and keep or drop it; nothing a peer sends ends it."""
        while True:
            raw = await self._sock.recv()
            self.handle(raw)

    def handle(self, raw: bytes) -> None:
        """Count one message for the prompt awaiting its id, or drop it (called by the listener)."""
        try:
            req_id = _DECODER.decode(raw).req_id
        except msgspec.DecodeError:
            self._drop("malformed")
            return
        entry = self._awaited.get(req_id)
        if entry is None:
            self._drop("unawaited")
        elif not entry.add():
            self._drop("surplus")

    def _drop(self, reason: str) -> None:
        self.dropped[reason] += 1
        self._unreported[reason] += 1
        if self._on_drop is not None:
            self._on_drop(reason)
        now = time.monotonic()
        if now >= self._next_report:
            counts = ", ".join(f"{n} {r}" for r, n in sorted(self._unreported.items()))
            log.warning("dropped LMCache notices on %s: %s (it keeps only ids of prompts awaiting their KV; "
                        "next report in %.0f s at the earliest)", self.endpoint, counts, DROP_LOG_INTERVAL_S)
            self._unreported.clear()
            self._next_report = now + DROP_LOG_INTERVAL_S

    async def aclose(self) -> None:
        """Stop the listener and close the socket (the handoff's ``aclose``, at proxy shutdown)."""
        self._task.cancel()
        with suppress(asyncio.CancelledError):
            await self._task
        self._sock.close(linger=0)
        self._ctx.term()


class LmcacheHandoff(VllmHandoff):
    """Prefill pushes the KV to the chosen decode's LMCache receiver; decode runs the request."""

    kind = LMCACHE_HANDOFF

    def __init__(self, upstream: Upstream, prefill: BackendPool, decode: BackendPool,
                 metrics: ProxyMetrics, options: Mapping[str, str] | None = None) -> None:
        super().__init__(upstream, prefill, decode, metrics, options)
        self.receivers = parse_receivers(tuple(b.url for b in decode.backends), self.options.get("receivers"))
        dropped = prometheus_client.Counter(
            "disagg_proxy_lmcache_notices_dropped", "LMCache notices the proxy dropped, by reason: unawaited "
            "(no prompt awaits the id), surplus (more than one per TP rank), malformed", ["reason"],
            registry=metrics.registry)
        for reason in DROP_REASONS:
            dropped.labels(reason)
        self.notices = KvNotices(parse_bind(self.options.get("notify")),
                                 on_drop=lambda reason: dropped.labels(reason).inc())

    async def aclose(self) -> None:
        """Close the notice socket (the proxy calls it on shutdown)."""
        await self.notices.aclose()

    @staticmethod
    def transfer_params(req_id: str, rec: Receiver) -> dict[str, Any]:
        """The ``kv_transfer_params`` prefill receives (LMCache's ``disagg_spec``)."""
        return {"ret_first_tok": True,
                "disagg_spec": {"req_id": req_id, "receiver_host": rec.host,
                                "receiver_init_port": list(rec.init_ports),
                                "receiver_alloc_port": list(rec.alloc_ports)}}

    @asynccontextmanager
    async def serve(self, route: PromptRoute) -> AsyncIterator[DecodeReply]:
        """Choose decode, prefill into its receiver, wait for the notices, then decode."""
        req = route.request
        preset = route.decode
        backend = preset if preset is not None and preset.healthy else self.decode.pick()
        if backend is None:
            raise NoHealthyBackend(f"no healthy decode instance: {self.decode.describe()}")
        rec = self.receivers[backend.url]
        req_id = f"disagg-{req.request_id[:CLIENT_ID_CHARS]}-{uuid.uuid4().hex[:ID_RANDOM_HEX]}"
        route.decode = backend
        with self.decode.lease(backend):
            with self.notices.expect(req_id, len(rec.init_ports)) as kv_sent:
                await self.run_prefill(route, self.transfer_params(req_id, rec))
                prefill_done = time.perf_counter()
                arrived = await kv_sent.wait(self.upstream.timeouts.request)
            if not arrived:
                raise PrefillFailed("no_kv_notice", f"no LMCache notice for {req_id} within "
                                    f"{self.upstream.timeouts.request:.0f} s (is pd_proxy_port reachable?)")
            try:
                resp = await self.upstream.send(backend, "POST", req.endpoint, data=req.raw, headers=req.headers)
            except UpstreamConnectError as exc:
                self.decode.mark_down(backend, exc.message)
                raise
            try:
                yield DecodeReply(backend, resp, prefill_done=prefill_done)
            finally:
                finish(resp)
