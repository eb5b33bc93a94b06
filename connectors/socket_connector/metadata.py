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
    #: streaming: the transfer key the prefill side knows its request by; ``remote_block_ids``
    #: then only counts P's blocks (their ids are P's business) and ``remote_num_tokens`` is
    #: the prompt length both sides must agree on
    stream_key: str | None = None
    remote_num_tokens: int = 0


@dataclass
class SendSpec:
    """Prefill side: hold ``block_ids`` for a decode engine for ``ttl_s`` seconds."""

    block_ids: list[int]
    ttl_s: float
    #: the request streamed its KV under this key (streams.py): the lease ends when the stream has
    #: sent everything, not at the decode side's release
    stream_key: str | None = None


@dataclass
class StreamStep:
    """Prefill side, streaming: one step's progress of a streamed request.

    Before the step's forward the first ``ready_before`` prompt tokens' KV is in the cache at
    every layer (computed earlier, or a prefix-cache hit); after layer L's part of the forward,
    the first ``ready_after`` are at layer L. ``block_ids``: the request's blocks so far.
    """

    request_id: str
    num_tokens: int
    block_ids: list[int]
    ready_before: int
    ready_after: int


@dataclass
class SocketConnectorMetadata(KVConnectorMetadata):
    """One step's new work: fetches to start, leases to register, streams' progress.

    ``idle_step``: the scheduler scheduled no tokens this step (vLLM steps an
    engine that only waits for KV transfers in a tight loop); the worker may
    then wait briefly for a transfer to end instead of returning at once.
    """

    reqs_to_recv: dict[str, RecvSpec] = field(default_factory=dict)
    reqs_to_send: dict[str, SendSpec] = field(default_factory=dict)
    idle_step: bool = False
    #: prefill side, streaming: stream key -> this step's progress of its request
    streams: dict[str, StreamStep] = field(default_factory=dict)
    #: prefill side, streaming: stream key -> why it ends before its request finished (aborted,
    #: preempted); applied before this step's forward, which may reuse the request's blocks
    stream_closes: dict[str, str] = field(default_factory=dict)
    #: decode side, streaming: requests whose running stream fetch must stop (aborted)
    recv_cancels: set[str] = field(default_factory=set)
