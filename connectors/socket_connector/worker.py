"""Worker-side half of the socket connector (runs next to the KV caches).

Prefill: owns the listener (TP rank r on port + r) and the lease table;
reports a request finished sending once the decode side released it or its
lease expired, so vLLM frees the blocks.

Decode: runs fetches on a small thread pool, straight into the allocated
blocks, over connections kept open between requests; reports each request
finished receiving (failed ones also as failed, so ``kv_load_failure_policy``
decides: ``recompute`` prefills locally, ``fail`` errors the request), and
only then releases the prefill side's lease.
"""

from __future__ import annotations

import queue
import sys
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
from .wireformat import default_blocks_per_message

logger = init_logger(__name__)


@dataclass(frozen=True)
class _Outcome:
    request_id: str
    ok: bool


class SocketWorker:
    """One TP rank's transfers."""

    def __init__(self, settings: SocketSettings, engine_id: str, is_producer: bool, tp_rank: int, tp_size: int,
                 num_blocks: int):
        self.settings = settings
        self.engine_id = engine_id
        self.is_producer = is_producer
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.num_blocks = num_blocks
        self.counters = TransferCounters()
        self.leases = LeaseTable()
        self.store: BlockStore | None = None
        self.server: KVServer | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._conns: PeerConnections | None = None
        self._outcomes: queue.SimpleQueue[_Outcome] = queue.SimpleQueue()
        self._fetches_in_flight = 0  # submitted and awaited, outcome not yet reported (engine thread only)

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
            self.server = KVServer(
                self.store, self.leases, self.settings.secret, self.settings.host, self.settings.port + self.tp_rank,
                engine_id=self.engine_id, rank=self.tp_rank, io_timeout_s=self.settings.io_timeout_s,
                registration_wait_s=self.settings.registration_wait_s, counters=self.counters,
                max_pending_handshakes=self.settings.max_pending_handshakes,
                handshake_timeout_s=self.settings.handshake_timeout_s,
            )
            self.server.start()
        else:
            self._pool = ThreadPoolExecutor(self.settings.max_parallel_fetches, thread_name_prefix="kv-socket-fetch")
            opts = FetchOptions(settings.streams, per_message, settings.connect_timeout_s, settings.io_timeout_s,
                                settings.handshake_timeout_s)
            self._conns = PeerConnections(self.settings.secret, self.store, opts,
                                          max_idle_per_peer=self.settings.streams * self.settings.max_parallel_fetches)

    def start_load_kv(self, meta: SocketConnectorMetadata) -> None:
        """Register new leases and start new fetches (never blocks on the network)."""
        for rid, send in meta.reqs_to_send.items():
            self.leases.register(rid, send.block_ids, send.ttl_s)
        for rid, spec in meta.reqs_to_recv.items():
            if self._pool is None:
                logger.error("socket KV connector: %s asks this producer to fetch; ignored", rid)
                continue
            self._pool.submit(self._run_fetch, rid, spec)
            if spec.awaiting:
                self._fetches_in_flight += 1

    def _plan(self, spec: RecvSpec) -> FetchPlan:
        return FetchPlan(spec.remote_host, spec.remote_port + self.tp_rank, spec.remote_request_id,
                         spec.remote_block_ids, spec.local_block_ids, spec.remote_engine_id)

    def _run_fetch(self, rid: str, spec: RecvSpec) -> None:
        conns = self._conns
        assert conns is not None
        plan = self._plan(spec)
        if not spec.awaiting:
            conns.release(plan)
            return
        ok = False
        release = True
        try:
            if spec.failure:
                release = False  # never contacted: nothing to release
                raise FetchError(spec.failure)
            if spec.remote_tp_size != self.tp_size:
                raise FetchError(f"prefill TP size {spec.remote_tp_size} != decode TP size {self.tp_size}")
            result = conns.fetch(plan)
            ok = True
            self.counters.add("transfer_duration", result.seconds)
            self.counters.add("bytes_transferred", result.nbytes)
            logger.info(
                "socket KV connector: fetched %s (%d blocks, %.2f MB) from %s:%d in %.1f ms (%.1f MB/s, %d streams; "
                "answered after %.1f ms)",
                rid, len(spec.local_block_ids), result.nbytes / 1e6, plan.host, plan.port, result.seconds * 1e3,
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
        results = KVConnectorTransferResults()
        released, expired = self.leases.reap(wait_s)
        for rid in expired:
            self.counters.add("num_kv_expired_reqs")
            logger.warning("socket KV connector: lease of %s expired after %.1f s; freeing its blocks",
                           rid, self.settings.lease_s)
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

    def shutdown(self) -> None:
        """Stop the listener and the fetch pool (idempotent)."""
        if self.server is not None:
            self.server.close()
            self.server = None
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        if self._conns is not None:
            self._conns.close()
            self._conns = None
