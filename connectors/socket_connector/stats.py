"""The socket connector's stats in vLLM's KV-connector metrics pipeline.

Workers drain TransferCounters into a SocketKVConnectorStats each step; vLLM
aggregates them, logs ``KV Transfer metrics: ...`` and feeds SocketPromMetrics,
which exports ``vllm:socket_kv_*`` on ``/metrics``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, cast

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from .counters import STAT_KEYS


@dataclass
class SocketKVConnectorStats(KVConnectorStats):
    """Lists of observations (see counters.STAT_KEYS); serializable."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()
        for key in STAT_KEYS:
            self.data.setdefault(key, [])

    def reset(self) -> None:
        """Empty every series."""
        self.data: dict[str, list[float]] = {key: [] for key in STAT_KEYS}

    def clone_and_reset(self) -> SocketKVConnectorStats:
        """A copy of the current series, leaving this object empty."""
        old = copy.copy(self)
        self.reset()
        return old

    def is_empty(self) -> bool:
        """True when nothing was observed."""
        return not any(self.data.get(key) for key in STAT_KEYS)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Concatenate another interval's observations onto ours."""
        for key in STAT_KEYS:
            self.data[key].extend(other.data.get(key, []))
        return self

    def reduce(self) -> dict[str, int | float]:
        """One line of figures for vLLM's periodic log."""
        secs = sum(self.data["transfer_duration"])
        mb = sum(self.data["bytes_transferred"]) / 2**20
        n = len(self.data["transfer_duration"])
        return {
            "Num successful transfers": n,
            "Avg xfer time (ms)": round(secs / n * 1e3, 3) if n else 0,
            "MB received": round(mb, 3),
            "Throughput (MB/s)": round(mb / secs, 1) if secs else 0,
            "MB served": round(sum(self.data["bytes_served"]) / 2**20, 3),
            "Num failed transfers": len(self.data["num_failed_transfers"]),
            "Num KV expired reqs": len(self.data["num_kv_expired_reqs"]),
            "Num refused": len(self.data["num_refused"]),
            "Num refused peers": len(self.data["num_refused_peers"]),
            "MB staged": round(self.data["staging_bytes"][-1] / 2**20, 3) if self.data["staging_bytes"] else 0,
        }


class SocketPromMetrics(KVConnectorPromMetrics):
    """``vllm:socket_kv_*`` Prometheus metrics."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def counter(name: str, doc: str) -> dict[int, PromMetric]:
            # vLLM is not followed by mypy (pyproject [tool.mypy]): its helper is Any
            return cast(
                "dict[int, PromMetric]",
                create_metric_per_engine(
                    self._counter_cls(name=name, documentation=doc, labelnames=labelnames), self.per_engine_labelvalues
                ),
            )

        self.xfer_time = create_metric_per_engine(
            self._histogram_cls(
                name="vllm:socket_kv_xfer_time_seconds",
                documentation="Seconds per socket KV fetch (decode side, all streams).",
                buckets=[0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0],
                labelnames=labelnames,
            ),
            self.per_engine_labelvalues,
        )
        self.staging = create_metric_per_engine(
            self._gauge_cls(
                name="vllm:socket_kv_staging_bytes",
                documentation="Host staging buffers held for KV transfers (0: blocks go straight from and to "
                              "the cache: host caches, raw wire format).",
                labelnames=labelnames,
                multiprocess_mode="mostrecent",
            ),
            self.per_engine_labelvalues,
        )
        self.counters = {
            "bytes_transferred": counter("vllm:socket_kv_bytes_received", "KV bytes fetched (decode side)."),
            "transfer_duration": counter("vllm:socket_kv_xfer_seconds", "Seconds spent fetching KV (decode side)."),
            "num_transfers": counter("vllm:socket_kv_transfers", "Successful KV fetches (decode side)."),
            "num_failed_transfers": counter("vllm:socket_kv_failed_transfers", "Failed KV fetches (decode side)."),
            "bytes_served": counter("vllm:socket_kv_bytes_served", "KV bytes sent (prefill side)."),
            "num_kv_expired_reqs": counter(
                "vllm:socket_kv_expired_reqs", "Leases that expired before the decode side fetched (prefill side)."
            ),
            "num_refused": counter(
                "vllm:socket_kv_refused", "Refused connections or fetches: bad secret, unknown request (prefill side)."
            ),
            "num_refused_peers": counter(
                "vllm:socket_kv_refused_peers",
                "Connections closed at accept: not from an allowed_peers address (prefill side).",
            ),
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Record one interval's observations."""
        for seconds in transfer_stats_data.get("transfer_duration", []):
            self.xfer_time[engine_idx].observe(seconds)
        self.counters["num_transfers"][engine_idx].inc(len(transfer_stats_data.get("transfer_duration", [])))
        staged = transfer_stats_data.get("staging_bytes", [])
        if staged:
            self.staging[engine_idx].set(staged[-1])
        for key, metric in self.counters.items():
            if key == "num_transfers":
                continue
            total = sum(transfer_stats_data.get(key, []))
            if total:
                metric[engine_idx].inc(total)
