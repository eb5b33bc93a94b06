"""vLLM with LMCache in P/D mode (``LMCacheConnectorV1``): the handoff of
LMCache's ``examples/disagg_prefill/disagg_proxy_server.py``.

1. The proxy picks the decode instance first: prefill must know where to push.
2. Prefill gets the client's request computing one token (as for NIXL) with
   ``kv_transfer_params = {"ret_first_tok": true, "disagg_spec": {req_id,
   receiver_host, receiver_init_port[], receiver_alloc_port[]}}``; its LMCache
   sender writes the KV into that decode's receiver buffer over NIXL.
3. Each prefill TP rank then pushes a ``ProxyNotif{req_id}`` (msgpack) to the
   proxy's ZMQ PULL socket (``pd_proxy_host:pd_proxy_port`` in the sender's
   YAML); the proxy waits for one per decode TP rank.
4. Decode gets the client's request unchanged; its LMCache receiver finds the
   prompt's KV in its buffer. (LMCache's example proxy instead appends
   prefill's first token and asks decode for one token fewer; sending the
   original request yields the same greedy output and keeps chat requests
   chat requests.)

If prefill fails or no notification comes within the request timeout, the
request falls back to decode alone (:class:`PrefillFailed`), as for NIXL.

Options (``--handoff-option``): ``receivers=[{"host": H, "init": [I1, I2], "alloc": [A1, A2]}, ...]``
(JSON, one object per ``--decode`` URL, in order: the receiver host, its init
ports and alloc ports per TP rank) and ``notify=BIND_HOST:PORT`` (where the proxy listens for the
notifications).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from disagg.errors import ProxyError
from disagg.proxy.backends import BackendPool
from disagg.proxy.errors import NoHealthyBackend, UpstreamConnectError
from disagg.proxy.handoff import DecodeReply, PrefillFailed, VllmHandoff
from disagg.proxy.metrics import ProxyMetrics
from disagg.proxy.routes import PromptRoute
from disagg.proxy.upstream import Upstream, finish

log = logging.getLogger("disagg.proxy")


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


class KvNotices:
    """The proxy's ZMQ PULL socket for LMCache's ``ProxyNotif`` messages."""

    def __init__(self, endpoint: str) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as exc:
            self._sock.close(linger=0)
            self._ctx.term()
            raise ProxyError(f"cannot listen for LMCache notices on {endpoint}: {exc}") from None
        self._counts: dict[str, int] = defaultdict(int)
        self._changed = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name="disagg-lmcache-notices")

    async def _run(self) -> None:
        while True:
            raw = await self._sock.recv()
            try:
                msg = msgspec.msgpack.decode(raw)
                req_id = str(msg["req_id"])
            except (msgspec.DecodeError, KeyError, TypeError):
                log.warning("ignored a malformed LMCache notice (%d bytes)", len(raw))
                continue
            self._counts[req_id] += 1
            self._changed.set()

    async def wait(self, req_id: str, count: int, timeout: float) -> bool:
        """True once ``count`` notices for ``req_id`` arrived; False after ``timeout`` seconds."""
        try:
            async with asyncio.timeout(timeout):
                while self._counts.get(req_id, 0) < count:
                    self._changed.clear()
                    await self._changed.wait()
            return True
        except TimeoutError:
            return False
        finally:
            self._counts.pop(req_id, None)

    async def aclose(self) -> None:
        self._task.cancel()
        with suppress(asyncio.CancelledError):
            await self._task
        self._sock.close(linger=0)
        self._ctx.term()


class LmcacheHandoff(VllmHandoff):
    """Prefill pushes the KV to the chosen decode's LMCache receiver; decode runs the request."""

    kind = "vllm-lmcache"

    def __init__(self, upstream: Upstream, prefill: BackendPool, decode: BackendPool,
                 metrics: ProxyMetrics, options: Mapping[str, str] | None = None) -> None:
        super().__init__(upstream, prefill, decode, metrics, options)
        self.receivers = parse_receivers(tuple(b.url for b in decode.backends), self.options.get("receivers"))
        self.notices = KvNotices(parse_bind(self.options.get("notify")))

    async def aclose(self) -> None:
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
        req_id = f"disagg-{req.request_id}-{uuid.uuid4().hex[:8]}"
        route.decode = backend
        with self.decode.lease(backend):
            await self.run_prefill(route, self.transfer_params(req_id, rec))
            prefill_done = time.perf_counter()
            if not await self.notices.wait(req_id, len(rec.init_ports), self.upstream.timeouts.request):
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
