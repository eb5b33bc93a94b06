"""The staging bytes a store holds (the gauge ``vllm:socket_kv_staging_bytes``): none for a host
cache in the raw wire format, per-thread buffers for fp8 that are counted out when their thread ends."""

from __future__ import annotations

import gc
import threading

from disagg_connectors.socket_connector.layout import make_store
from disagg_connectors.socket_connector.stats import SocketKVConnectorStats

from tests.unit.connectors.kvdata import NUM_BLOCKS, eventually, kv_caches


def test_a_raw_host_store_stages_nothing() -> None:
    store = make_store(kv_caches(1), NUM_BLOCKS)
    with store.reading([1, 2, 3]):
        assert store.staged_bytes == 0


def test_fp8_staging_is_counted_while_its_thread_holds_it_and_counted_out_after() -> None:
    store = make_store(kv_caches(1), NUM_BLOCKS, "fp8")
    seen: list[int] = []

    def read(n: int) -> None:
        with store.reading(list(range(n))):
            seen.append(store.staged_bytes)
        with store.reading(list(range(n + 2))):   # grows: the smaller buffers are counted out
            seen.append(store.staged_bytes)

    t = threading.Thread(target=read, args=(2,))
    t.start()
    t.join()
    per_block = store.layout.block_bytes
    assert seen == [2 * per_block, 4 * per_block]
    gc.collect()
    assert eventually(lambda: store.staged_bytes, 0) == 0


def test_the_stats_line_reports_the_latest_staging() -> None:
    stats = SocketKVConnectorStats(data={"staging_bytes": [2**20, 3 * 2**20]})
    assert stats.reduce()["MB staged"] == 3.0
    assert SocketKVConnectorStats().reduce()["MB staged"] == 0
