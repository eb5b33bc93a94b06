"""Scheduler-side half of the socket connector (runs in the engine core).

Prefill (kv_producer): a request that arrives with ``do_remote_decode`` runs
normally; when it finishes, its blocks are kept (delay free) and its
``kv_transfer_params`` name this engine's listener, the request and its block
ids. The lease is registered with the workers in the next step's metadata.

Decode (kv_consumer): a request that arrives with ``do_remote_prefill``
reports its prompt tokens as external and loaded asynchronously; once vLLM has
allocated blocks, the fetch is handed to the workers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from disagg_connectors.socket_connector.config import SocketSettings
from disagg_connectors.socket_connector.metadata import (
    REQUIRED_REMOTE_KEYS,
    RecvSpec,
    SendSpec,
    SocketConnectorMetadata,
)
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

logger = init_logger(__name__)

TRANSFER_NAME = "socket"


def has_remote(params: dict[str, Any]) -> bool:
    """Whether ``kv_transfer_params`` carry everything needed to fetch."""
    return all(params.get(k) is not None for k in REQUIRED_REMOTE_KEYS)


class SocketScheduler:
    """Tracks leases to announce and fetches to start."""

    def __init__(self, vllm_config: VllmConfig, engine_id: str, settings: SocketSettings):
        self.engine_id = engine_id
        self.settings = settings
        self.block_size = vllm_config.cache_config.block_size
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self._need_recv: dict[str, RecvSpec] = {}
        self._need_send: dict[str, SendSpec] = {}

    # -- decode side ------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Decode side: every prompt token P computed is external, loaded asynchronously."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or not has_remote(params):
            return 0, False
        remote_tokens = int(params.get("remote_num_tokens") or request.num_prompt_tokens)
        count = min(remote_tokens, request.num_prompt_tokens) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Decode side: remember where the fetched blocks go."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # one transfer per request
        if not has_remote(params):
            logger.warning("socket KV connector: incomplete kv_transfer_params for %s: %s",
                           request.request_id, params)
            return
        local = blocks.get_unhashed_block_ids() if num_external_tokens > 0 else []
        self._need_recv[request.request_id] = self._recv_spec(params, local, awaiting=num_external_tokens > 0)

    def _recv_spec(self, params: dict[str, Any], local: list[int], awaiting: bool) -> RecvSpec:
        remote = [int(b) for b in params["remote_block_ids"]]
        if local:
            # A local prefix-cache hit covers the leading blocks: fetch the tail.
            remote = remote[-len(local):] if len(local) <= len(remote) else remote
        return RecvSpec(
            local_block_ids=list(local),
            remote_block_ids=remote,
            remote_request_id=str(params["remote_request_id"]),
            remote_host=str(params["remote_host"]),
            remote_port=int(params["remote_port"]),
            remote_tp_size=int(params.get("tp_size") or 1),
            awaiting=awaiting,
            remote_engine_id=params.get("remote_engine_id"),
        )

    # -- both -------------------------------------------------------------
    def build_connector_meta(self, idle_step: bool = False) -> SocketConnectorMetadata:
        """Hand this step's new fetches and leases to the workers (``idle_step``: no tokens scheduled)."""
        meta = SocketConnectorMetadata(reqs_to_recv=self._need_recv, reqs_to_send=self._need_send,
                                       idle_step=idle_step)
        self._need_recv, self._need_send = {}, {}
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Prefill side: keep the blocks and say where to fetch them. Decode side: tidy up."""
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get("do_remote_prefill"):
            # Decode request aborted before it was scheduled: free P's lease.
            params["do_remote_prefill"] = False
            if has_remote(params):
                self._need_recv[request.request_id] = self._recv_spec(params, [], awaiting=False)
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None
        if self.settings.port is None:
            logger.warning("socket KV connector: request %s asks for remote decode but this engine "
                           "has no listener port (kv_role must be kv_producer)", request.request_id)
            return False, None
        delay = bool(block_ids)
        if delay:
            self._need_send[request.request_id] = SendSpec(list(block_ids), self.settings.lease_s)
        return delay, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": list(block_ids),
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            "remote_host": self.settings.host,
            "remote_port": self.settings.port,
            "remote_num_tokens": request.num_computed_tokens,
            "tp_size": self.tp_size,
            "transfer": TRANSFER_NAME,
            "lease_s": self.settings.lease_s,
        }
