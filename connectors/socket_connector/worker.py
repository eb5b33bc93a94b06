"""Worker-side half of the socket connector (runs next to the KV caches).

Prefill: owns the listener (TP rank r on port + r) and the lease table;
reports a request finished sending once the decode side released it or its
lease expired, so vLLM frees the blocks.

Decode: runs fetches on a small thread pool, straight into the allocated
blocks, over connections kept open between requests; reports each request
finished receiving (failed ones also as failed, so ``kv_load_failure_policy``
decides: ``recompute`` prefills locally, ``fail`` errors the request), and
only then releases the prefill side's lease.

Streamed transfers (streams.py): on the prefill side the connector calls
:meth:`SocketWorker.bind_step` before each forward, :meth:`save_layer` after
each attention layer and :meth:`step_saved` at the forward's end, which tell
the stream table what the listener may send; on the decode side a stream runs
on its own pool (it lasts as long as the remote prefill) and is cut when the
scheduler says its request was aborted.
"""

from __future__ import annotations

import queue
import socket
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.logger import init_logger

from .client import FetchError, FetchOptions, FetchPlan, PeerConnections
from .config import SocketSettings
from .counters import TransferCounters
from .layout import BlockStore, make_store
from .leases import LeaseTable
from .metadata import RecvSpec, SocketConnectorMetadata
from .server import KVServer
from .streams import StreamTable
from .wireformat import default_blocks_per_message

logger = init_logger(__name__)


@dataclass(frozen=True)
class _Outcome:
    request_id: str
    ok: bool


class SocketWorker:
    """One TP rank's transfers."""

    def __init__(self, settings: SocketSettings, engine_id: str, is_producer: bool, tp_rank: int, tp_size: int,
                 num_blocks: int, block_size: int = 16):
        self.settings = settings
        self.engine_id = engine_id
        self.is_producer = is_producer
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.counters = TransferCounters()
        self.leases = LeaseTable()
        self.store: BlockStore | None = None
        self.server: KVServer | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._conns: PeerConnections | None = None
        self._outcomes: queue.SimpleQueue[_Outcome] = queue.SimpleQueue()
        self._fetches_in_flight = 0  # submitted and awaited, outcome not yet reported (engine thread only)
        self._staged_reported = 0    # the staging bytes last reported to the stats
        #: prefill side: streamed requests' progress (None until the caches are registered)
        self.streams: StreamTable | None = None
        self._layer_index: dict[str, int] = {}
        self._on_device = False
        #: decode side: streams submitted and not over (request id -> their connection; None before it
        #: exists), and those of them cut (their request was aborted)
        self._stream_pool: ThreadPoolExecutor | None = None
        self._stream_socks: dict[str, socket.socket | None] = {}
        self._cancelled: set[str] = set()
        self._stream_lock = threading.Lock()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Map the KV caches; on a producer, start listening."""
        if self.settings.gil_switch_interval_ms > 0:
            # Transfer threads return to Python once per message; let them in quickly.
            sys.setswitchinterval(self.settings.gil_switch_interval_ms / 1000)
        self.store = make_store(kv_caches, self.num_blocks, self.settings.wire_format)
        settings = self.settings
        per_message = settings.blocks_per_message or default_blocks_per_message(self.store.layout)
        logger.info("socket KV connector: %d layers, %d bytes per block on the wire (%s), %s store, "
                    "%d blocks per message, GIL switch interval %.2f ms", len(self.store.layout.layers),
                    self.store.layout.block_bytes, self.store.layout.wire, type(self.store).__name__,
                    per_message, sys.getswitchinterval() * 1000)
        if self.is_producer:
            assert self.settings.port is not None
            names = [layer.name for layer in self.store.layout.layers]
            self._layer_index = {name: i for i, name in enumerate(names)}
            self._on_device = any(t.device.type != "cpu" for t in kv_caches.values())
            self.streams = StreamTable(self.block_size, len(names))
            self.server = KVServer(
                self.store, self.leases, self.settings.secret, self.settings.host, self.settings.port + self.tp_rank,
                engine_id=self.engine_id, rank=self.tp_rank, io_timeout_s=self.settings.io_timeout_s,
                registration_wait_s=self.settings.registration_wait_s, counters=self.counters,
                max_pending_handshakes=self.settings.max_pending_handshakes,
                max_pending_per_source=self.settings.max_pending_handshakes_per_source,
                allowed_peers=self.settings.allowed_peers,
                handshake_timeout_s=self.settings.handshake_timeout_s,
                streams=self.streams, stream_wait_s=self.settings.stream_wait_s,
            )
            self.server.start()
        else:
            self._pool = ThreadPoolExecutor(self.settings.max_parallel_fetches, thread_name_prefix="kv-socket-fetch")
            self._stream_pool = ThreadPoolExecutor(self.settings.max_parallel_streams,
                                                   thread_name_prefix="kv-socket-stream")
            opts = FetchOptions(settings.streams, per_message, settings.connect_timeout_s, settings.io_timeout_s,
                                settings.handshake_timeout_s)
            self._conns = PeerConnections(self.settings.secret, self.store, opts,
                                          max_idle_per_peer=self.settings.streams * self.settings.max_parallel_fetches)

    # -- prefill side, streaming (engine thread, inside the forward) ----------------
    def bind_step(self, meta: SocketConnectorMetadata) -> None:
        """Before the step's forward: open streams, advance them to what is already written, end
        those whose request was aborted or preempted (waiting for any read of their blocks)."""
        if self.streams is None or not (meta.streams or meta.stream_closes):
            return
        for key in self.streams.bind_step(meta.streams, meta.stream_closes):
            logger.warning("socket KV connector: stream key %s... is already used by another request; "
                           "not streaming request %s", key[:8], meta.streams[key].request_id)

    def _event(self) -> torch.cuda.Event | None:
        """An event on the current accelerator stream (the listener waits on it before reading)."""
        if not self._on_device:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def save_layer(self, layer_name: str) -> None:
        """The forward wrote ``layer_name``'s KV for this step."""
        if self.streams is not None and self.streams.stepping:
            index = self._layer_index.get(layer_name)
            if index is not None:
                self.streams.mark_layer(index, self._event())

    def step_saved(self) -> None:
        """The forward is over: everything it wrote may be streamed."""
        if self.streams is not None and self.streams.stepping:
            self.streams.mark_step(self._event())

    def start_load_kv(self, meta: SocketConnectorMetadata) -> None:
        """Register new leases, start new fetches and streams, cut aborted streams (never blocks
        on the network)."""
        for rid, send in meta.reqs_to_send.items():
            self.leases.register(rid, send.block_ids, send.ttl_s)
            if send.stream_key is not None and self.streams is not None and self.streams.finished(send.stream_key, rid):
                self.leases.release(rid)  # the stream already sent everything
        for rid in meta.recv_cancels:
            self._cancel_stream(rid)
        for rid, spec in meta.reqs_to_recv.items():
            pool = self._stream_pool if spec.stream_key is not None and spec.awaiting else self._pool
            if pool is None:
                logger.error("socket KV connector: %s asks this producer to fetch; ignored", rid)
                continue
            if pool is self._stream_pool:
                with self._stream_lock:
                    self._stream_socks[rid] = None
            pool.submit(self._run_fetch, rid, spec)
            if spec.awaiting:
                self._fetches_in_flight += 1

    def _cancel_stream(self, rid: str) -> None:
        """Cut ``rid``'s stream (its request was aborted): at once if connected, else as it connects."""
        with self._stream_lock:
            if rid not in self._stream_socks:
                return  # over, or never streamed
            self._cancelled.add(rid)
            sock = self._stream_socks[rid]
        _cut(sock)

    def _track(self, rid: str, sock: socket.socket | None) -> None:
        """The stream's current connection (``PeerConnections.stream`` tells it): cut at once when the
        request was aborted meanwhile."""
        if sock is None:
            return
        with self._stream_lock:
            self._stream_socks[rid] = sock
            cut = rid in self._cancelled
        if cut:
            _cut(sock)

    def _stream_over(self, rid: str) -> None:
        with self._stream_lock:
            self._stream_socks.pop(rid, None)
            self._cancelled.discard(rid)

    def _plan(self, spec: RecvSpec) -> FetchPlan:
        first = spec.remote_block_ids[0] if spec.stream_key is not None and spec.remote_block_ids else 0
        return FetchPlan(spec.remote_host, spec.remote_port + self.tp_rank, spec.remote_request_id,
                         spec.remote_block_ids, spec.local_block_ids, spec.remote_engine_id,
                         stream_key=spec.stream_key, num_tokens=spec.remote_num_tokens, first_block=first)

    def _run_fetch(self, rid: str, spec: RecvSpec) -> None:
        conns = self._conns
        assert conns is not None
        plan = self._plan(spec)
        streamed = spec.stream_key is not None
        if not spec.awaiting:  # nothing to receive: P frees the blocks now (a stream: P's lease ends at once)
            conns.release(plan)
            return
        ok = False
        release = not streamed  # a streamed transfer's lease ends when the stream sent everything
        try:
            if spec.failure:
                release = False  # never contacted: nothing to release
                raise FetchError(spec.failure)
            if spec.remote_tp_size != self.tp_size:
                raise FetchError(f"prefill TP size {spec.remote_tp_size} != decode TP size {self.tp_size}")
            if streamed:
                with self._stream_lock:
                    if rid in self._cancelled:
                        raise FetchError("request aborted before its stream started")
                result = conns.stream(plan, lambda sock: self._track(rid, sock))
            else:
                result = conns.fetch(plan)
            ok = True
            self.counters.add("transfer_duration", result.seconds)
            self.counters.add("bytes_transferred", result.nbytes)
            logger.info(
                "socket KV connector: %s %s (%d blocks, %.2f MB) from %s:%d in %.1f ms (%.1f MB/s, %d streams; "
                "answered after %.1f ms)",
                "streamed" if streamed else "fetched", rid, len(spec.local_block_ids), result.nbytes / 1e6,
                plan.host, plan.port, result.seconds * 1e3,
                result.nbytes / 1e6 / max(result.seconds, 1e-9), result.streams, result.answered_s * 1e3,
            )
        except FetchError as exc:
            self.counters.add("num_failed_transfers")
            release = release and exc.reached_peer
            logger.warning("socket KV connector: fetch of %s failed: %s", rid, exc)
        except Exception:
            self.counters.add("num_failed_transfers")
            logger.exception("socket KV connector: fetch of %s crashed", rid)
        finally:
            if streamed:
                self._stream_over(rid)
            self._outcomes.put(_Outcome(rid, ok))
        if release:
            # After reporting: the request goes on (or recomputes) while the prefill side frees its blocks.
            conns.release(plan)

    def get_transfer_results(self, idle_step: bool = False) -> KVConnectorTransferResults:
        """Requests done sending (released or expired) and done receiving (ok or failed).

        On an ``idle_step`` (no tokens scheduled) with transfers in flight and
        none ended, waits up to ``idle_wait_ms`` for one instead of handing
        the CPU straight back to the engine's spinning loop.
        """
        wait_s = self.settings.idle_wait_ms / 1000 if idle_step else 0.0
        self._report_staging()
        results = KVConnectorTransferResults()
        released, expired = self.leases.reap(wait_s)
        for rid in expired:
            self.counters.add("num_kv_expired_reqs")
            logger.warning("socket KV connector: lease of %s expired after %.1f s; freeing its blocks",
                           rid, self.settings.lease_s)
        streams = self.streams
        for rid in expired:
            key = streams.key_of(rid) if streams is not None else None
            if streams is not None and key is not None:  # no stream thread may read the blocks once vLLM frees them
                streams.close(key, f"lease expired after {self.settings.lease_s:g} s")
        results.finished_sending = released | expired
        wait_s = wait_s if self._fetches_in_flight else 0.0
        while True:
            try:
                outcome = self._outcomes.get(timeout=wait_s) if wait_s > 0 else self._outcomes.get_nowait()
            except queue.Empty:
                break
            wait_s = 0.0
            self._fetches_in_flight -= 1
            results.finished_recving.add(outcome.request_id)
            if not outcome.ok:
                results.failed_recving.add(outcome.request_id)
        return results

    def _report_staging(self) -> None:
        """Put the store's staging bytes in the stats when they changed (the gauge
        ``vllm:socket_kv_staging_bytes``; 0 for a host cache in the raw wire format)."""
        staged = self.store.staged_bytes if self.store is not None else 0
        if staged != self._staged_reported:
            self._staged_reported = staged
            self.counters.add("staging_bytes", staged)

    def shutdown(self) -> None:
        """Stop the listener and the fetch pool (idempotent)."""
        if self.server is not None:
            self.server.close()
            self.server = None
        for pool in (self._pool, self._stream_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        self._pool = self._stream_pool = None
        with self._stream_lock:
            socks = list(self._stream_socks.values())
        for sock in socks:
            _cut(sock)
        if self._conns is not None:
            self._conns.close()
            self._conns = None


def _cut(sock: socket.socket | None) -> None:
    """Shut a stream's connection down both ways: the thread blocked reading it returns at once."""
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
