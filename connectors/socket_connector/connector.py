"""``SocketKVConnector``: KV cache over plain authenticated TCP, for stock vLLM.

Load it with::

    --kv-transfer-config '{"kv_connector": "SocketKVConnector",
        "kv_connector_module_path": "disagg_connectors.socket_connector",
        "kv_role": "kv_producer" | "kv_consumer",
        "kv_connector_extra_config": {"host": "10.0.0.1", "port": 5601}}'

with the shared secret in env ``DISAGG_KV_SECRET`` on both engines. The facade
only forwards: SocketScheduler (scheduler.py) and SocketWorker (worker.py) do
the work, as NixlConnector splits its own.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.logger import init_logger
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from .config import SocketSettings
from .metadata import SocketConnectorMetadata
from .scheduler import SocketScheduler
from .stats import SocketKVConnectorStats, SocketPromMetrics
from .worker import SocketWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)


def _share_vllm_log_handlers() -> None:
    """Send this package's log lines (transport threads) where vLLM's go."""
    ours, theirs = logging.getLogger("disagg_connectors"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(theirs.level or logging.INFO)
        ours.propagate = False


class SocketKVConnector(KVConnectorBase_V1):
    """Pull-mode P/D KV transfer over TCP with HMAC-authenticated connections."""

    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config, role, kv_cache_config)
        _share_vllm_log_handlers()
        cfg = self._kv_transfer_config
        if len(kv_cache_config.kv_cache_groups) > 1:
            raise NotImplementedError("the socket KV connector supports models with one KV cache group")
        assert cfg.engine_id is not None
        self.engine_id: str = cfg.engine_id
        self.settings = SocketSettings.load(cfg.kv_connector_extra_config, need_port=cfg.is_kv_producer)
        self.scheduler: SocketScheduler | None = None
        self.worker: SocketWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SocketScheduler(vllm_config, self.engine_id, self.settings,
                                             is_producer=cfg.is_kv_producer)
        else:
            from vllm.distributed.parallel_state import (
                get_tensor_model_parallel_rank,
                get_tensor_model_parallel_world_size,
            )

            self.worker = SocketWorker(
                self.settings, self.engine_id, cfg.is_kv_producer, get_tensor_model_parallel_rank(),
                get_tensor_model_parallel_world_size(), kv_cache_config.num_blocks,
                block_size=vllm_config.cache_config.block_size,
            )

    # -- scheduler side ---------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.request_finished(request, block_ids)

    # -- worker side ------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Before the step's forward (vLLM calls it there): streams learn what this step writes,
        and those ending now stop reading blocks the forward may reuse."""
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None and isinstance(connector_metadata, SocketConnectorMetadata):
            self.worker.bind_step(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, SocketConnectorMetadata)
        self.worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are whole-request and asynchronous: nothing to wait for per layer."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        """Nothing is copied: a streamed request's listener may now send this layer's new blocks."""
        if self.worker is not None:
            self.worker.save_layer(layer_name)

    def wait_for_save(self) -> None:
        """End of the forward: a streamed request's listener may send everything it wrote."""
        if self.worker is not None:
            self.worker.step_saved()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self.worker is not None
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        idle = isinstance(meta, SocketConnectorMetadata) and meta.idle_step
        return self.worker.get_transfer_results(idle_step=idle)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.worker is None:
            return None
        data = self.worker.counters.drain()
        return SocketKVConnectorStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return SocketKVConnectorStats(data=data or {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return SocketPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
