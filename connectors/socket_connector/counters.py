"""Thread-safe transfer counters, drained into vLLM's KV connector stats each step."""

from __future__ import annotations

import threading

#: Keys of the stats payload (lists, so aggregation is concatenation).
STAT_KEYS = (
    "transfer_duration",  # seconds per successful fetch (decode side)
    "bytes_transferred",  # bytes per successful fetch (decode side)
    "num_failed_transfers",  # 1 per failed fetch (decode side)
    "bytes_served",  # bytes per served fetch stream (prefill side)
    "num_kv_expired_reqs",  # 1 per lease that expired (prefill side)
    "num_refused",  # 1 per refused connection or fetch (prefill side)
    "num_refused_peers",  # 1 per connection closed at accept: not from an allowed_peers address (prefill side)
    "staging_bytes",  # host staging buffers allocated now, each time it changes (both sides)
)


class TransferCounters:
    """Observations since the last drain."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, list[float]] = {k: [] for k in STAT_KEYS}

    def add(self, key: str, value: float = 1) -> None:
        """Record one observation under ``key`` (one of STAT_KEYS)."""
        with self._lock:
            self._data[key].append(value)

    def drain(self) -> dict[str, list[float]] | None:
        """Everything recorded since the last drain, or None if nothing was."""
        with self._lock:
            if not any(self._data.values()):
                return None
            data, self._data = self._data, {k: [] for k in STAT_KEYS}
            return data
