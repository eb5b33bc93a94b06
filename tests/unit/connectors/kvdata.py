"""Shared test data for the socket connector's unit tests: small KV caches in
vLLM's CPU layout and a listener serving them."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
from disagg_connectors.socket_connector.counters import TransferCounters
from disagg_connectors.socket_connector.layout import make_store
from disagg_connectors.socket_connector.leases import LeaseTable
from disagg_connectors.socket_connector.server import KVServer

SECRET = b"0123456789abcdef0123456789abcdef"
NUM_BLOCKS = 32


def kv_caches(seed: int, fill: bool = True) -> dict[str, torch.Tensor]:
    """Two layers in vLLM's CPU layout [num_blocks, kv_heads, block_size, 2*head] (bf16)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"):
        t = torch.zeros(NUM_BLOCKS, 2, 16, 128, dtype=torch.bfloat16)
        if fill:
            t.copy_(torch.randn(t.shape, generator=g).to(torch.bfloat16))
        out[name] = t
    return out


def eventually(probe, expected, timeout_s: float = 5.0):
    """Poll ``probe()`` until it returns ``expected`` (server threads finish a moment
    after the client has its answer); returns the last value."""
    deadline = time.monotonic() + timeout_s
    while (value := probe()) != expected and time.monotonic() < deadline:
        time.sleep(0.02)
    return value


def reaped(table: LeaseTable):
    """Accumulate reap() results, so polling does not lose a reported lease."""
    done: set[str] = set()
    expired: set[str] = set()

    def probe() -> tuple[set[str], set[str]]:
        d, e = table.reap()
        done.update(d)
        expired.update(e)
        return done, expired

    return probe


@pytest.fixture
def served() -> Iterator[tuple[KVServer, dict[str, torch.Tensor]]]:
    """A listener on 127.0.0.1 serving kv_caches(7); yields (server, caches)."""
    caches = kv_caches(7)
    leases = LeaseTable()
    server = KVServer(make_store(caches, NUM_BLOCKS), leases, SECRET, "127.0.0.1", 0,
                      registration_wait_s=0.2, io_timeout_s=5, counters=TransferCounters())
    server.start()
    yield server, caches
    server.close()


