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


def test_a_thread_stages_one_layer_at_a_time_not_every_layer() -> None:
    """Staged stores move one layer per message: a thread's buffer holds that layer's blocks, carved
    from one allocation that later layers reuse, and the bytes come out as the cache holds them."""
    caches = kv_caches(1)
    store = make_store(caches, NUM_BLOCKS, "fp8")
    layer_bytes = store.layout.layers[0].block_bytes
    seen: list[int] = []
    for layer in range(len(store.layout.layers)):
        with store.reading([1, 2, 3], [layer]) as views:
            assert sum(len(v) for v in views) == 3 * layer_bytes
            seen.append(store.staged_bytes)
    assert seen == [3 * layer_bytes] * len(store.layout.layers)
    assert 3 * layer_bytes < 3 * store.layout.block_bytes      # not every layer's blocks at once

