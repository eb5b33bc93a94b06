"""What the scheduler-side connector tells its workers each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class RecvSpec:
    """Decode side: fetch ``remote_block_ids`` of a prefill request into ``local_block_ids``.

    ``local_block_ids`` empty means release only (local cache hit or abort):
    nothing is awaited. ``failure`` set: the scheduler could not start this
    fetch after promising it; the worker reports it failed at once (vLLM then
    recomputes) without contacting anyone.
    """

    local_block_ids: list[int]
    remote_block_ids: list[int]
    remote_request_id: str
    remote_host: str
    remote_port: int
    remote_tp_size: int
    awaiting: bool
    remote_engine_id: str | None = None
    failure: str | None = None


@dataclass
class SendSpec:
    """Prefill side: hold ``block_ids`` for a decode engine for ``ttl_s`` seconds."""

    block_ids: list[int]
    ttl_s: float


@dataclass
class SocketConnectorMetadata(KVConnectorMetadata):
    """One step's new work: fetches to start, leases to register.

    ``idle_step``: the scheduler scheduled no tokens this step (vLLM steps an
    engine that only waits for KV transfers in a tight loop); the worker may
    then wait briefly for a transfer to end instead of returning at once.
    """

    reqs_to_recv: dict[str, RecvSpec] = field(default_factory=dict)
    reqs_to_send: dict[str, SendSpec] = field(default_factory=dict)
    idle_step: bool = False
