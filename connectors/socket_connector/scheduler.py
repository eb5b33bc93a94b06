"""Scheduler-side half of the socket connector (runs in the engine core).

Prefill (kv_producer): a request that arrives with ``do_remote_decode`` runs
normally; when it finishes, its blocks are kept (delay free) and its
``kv_transfer_params`` name this engine's listener, the request and its block
ids. The lease is registered with the workers in the next step's metadata.

Decode (kv_consumer): a request that arrives with ``do_remote_prefill``
reports its prompt tokens as external and loaded asynchronously; once vLLM has
allocated blocks, the fetch is handed to the workers.

Streamed transfers (``stream_key`` in both engines' params, sent at once by
the proxy): the prefill side reports each step's progress of the request to
its workers (``StreamStep``: blocks, tokens ready before and after the step),
ends the stream when the request is aborted or preempted, and keeps the
blocks under a lease when it finishes, until the stream has sent them; the
decode side starts the stream as soon as its blocks are allocated and cuts
it when its request is aborted.

``kv_transfer_params`` come from any HTTP client, and an exception in a
scheduler hook kills vLLM's engine core. So every field is validated
(``params.py``) before use: a request whose params fail is *declined* with one
warning naming the request and the field, and then served as if it had none
(decode computes the prompt itself, prefill keeps no lease). The hooks also
catch anything unexpected and decline the same way: none raises on client
input. The prefill side also takes no lease (and streams nothing) for a
request whose own id the decode side would refuse (``params.is_request_id``,
the one check both sides apply): blocks are never held for a fetch that
cannot come.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from .config import SocketSettings
from .metadata import (
    RecvSpec,
    SendSpec,
    SocketConnectorMetadata,
    StreamStep,
)
from .params import (
    MAX_REQUEST_ID_CHARS,
    TRANSFER_NAME,
    Declined,
    RemotePrefill,
    check_remote_decode,
    check_remote_prefill,
    is_request_id,
    quote,
    stream_key_of,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)

class SocketScheduler:
    """Tracks leases to announce and fetches to start."""

    def __init__(self, vllm_config: VllmConfig, engine_id: str, settings: SocketSettings,
                 is_producer: bool | None = None):
        self.engine_id = engine_id
        self.settings = settings
        self.block_size = vllm_config.cache_config.block_size
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        if is_producer is None:
            kv_cfg = getattr(vllm_config, "kv_transfer_config", None)
            is_producer = bool(kv_cfg.is_kv_producer) if kv_cfg is not None else settings.port is not None
        #: A producer serves leases and never fetches (its workers have no fetch pool).
        self.is_producer = is_producer
        self._need_recv: dict[str, RecvSpec] = {}
        self._need_send: dict[str, SendSpec] = {}
        #: prefill side: streamed requests (request id -> (key, prompt tokens)) until they end
        self._streams: dict[str, tuple[str, int]] = {}
        self._stream_ended: set[str] = set()  # preempted: not streamed again when resumed
        self._stream_closes: dict[str, str] = {}
        #: decode side: requests whose KV is being streamed in (cut when they are aborted)
        self._streaming_in: set[str] = set()
        self._recv_cancels: set[str] = set()
        #: prefill side: requests given no lease because the decode side would refuse their id
        #: (the scheduler process has no stats of its own; the warning is logged per request)
        self.refused_request_ids = 0

    # -- validation ---------------------------------------------------------
    def _decline(self, request: Request, declined: Declined, consequence: str) -> None:
        """Log one line and make the request's params inert, so no later hook acts on them (or logs again)."""
        logger.warning("socket KV connector: request %s: declining kv_transfer_params: %s %s; %s",
                       request.request_id, declined.field, declined.reason, consequence)
        self._make_inert(request)

    @staticmethod
    def _make_inert(request: Request) -> None:
        """Turn the request's transfer flags off, so no later hook acts on its params."""
        params = request.kv_transfer_params
        try:
            params["do_remote_prefill"] = False
            params["do_remote_decode"] = False
        except Exception:  # not a mutable mapping (vLLM gives a dict): drop them altogether
            request.kv_transfer_params = None

    def _id_refused(self, request: Request) -> bool:
        """Prefill side, before anything leases or streams a remote-decode request's blocks: True
        (after one warning, counted in :attr:`refused_request_ids`, and with the params made inert)
        when its id is one the decode side refuses (:func:`.params.is_request_id`). Called by
        :meth:`_open_stream` (the request's first schedule) and :meth:`_request_finished`."""
        if is_request_id(request.request_id):
            return False
        self.refused_request_ids += 1
        logger.warning("socket KV connector: request %s: its id is not 1..%d printable ASCII characters without "
                       "spaces, which the decode side refuses; keeping no lease for it (its decode engine "
                       "computes the prompt)", quote(request.request_id), MAX_REQUEST_ID_CHARS)
        self._make_inert(request)
        return True

    def _remote_prefill(self, request: Request) -> RemotePrefill | None:
        """Decode side: the request's validated remote prefill, or None (none asked, or declined now)."""
        params = request.kv_transfer_params
        if not params:
            return None
        if self.is_producer:
            flag = params.get("do_remote_prefill") if isinstance(params, dict) else None
            if flag is not None and flag is not False:
                self._decline(request, Declined("do_remote_prefill", "is set on a prefill engine "
                                                "(kv_producer), which never fetches"), "computing it here")
            return None
        check = check_remote_prefill(params, num_prompt_tokens=request.num_prompt_tokens,
                                     block_size=self.block_size, peers=self.settings.peers)
        if isinstance(check, Declined):
            self._decline(request, check, "computing the prompt locally")
            return None
        return check

    def _crashed(self, request: Request, hook: str, consequence: str) -> None:
        """A hook failed unexpectedly: log it (with the traceback) and decline the request's params."""
        logger.exception("socket KV connector: %s failed for request %s; %s", hook,
                         getattr(request, "request_id", "?"), consequence)
        try:
            self._decline(request, Declined("kv_transfer_params", f"could not be handled in {hook}"), consequence)
        except Exception:
            pass

    # -- decode side ------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Decode side: every prompt token P computed is external, loaded asynchronously."""
        try:
            remote = self._remote_prefill(request)
            if remote is None:
                return 0, False
            count = remote.num_tokens - num_computed_tokens
            return (count, True) if count > 0 else (0, False)
        except Exception:
            self._crashed(request, "get_num_new_matched_tokens", "computing the prompt locally")
            return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Decode side: remember where the fetched blocks go."""
        try:
            if self.is_producer:
                self._open_stream(request)
                return
            remote = self._remote_prefill(request)
            if remote is None:
                if num_external_tokens > 0:  # promised a load we cannot start: fail it, vLLM recomputes
                    self._need_recv[request.request_id] = _failed_spec("kv_transfer_params declined after the "
                                                                       "load was promised")
                return
            request.kv_transfer_params["do_remote_prefill"] = False  # one transfer per request
            local = blocks.get_unhashed_block_ids() if num_external_tokens > 0 else []
            self._need_recv[request.request_id] = self._recv_spec(remote, local, awaiting=num_external_tokens > 0)
            if remote.stream_key is not None and local:
                self._streaming_in.add(request.request_id)
        except Exception:
            self._crashed(request, "update_state_after_alloc", "computing the prompt locally")
            if num_external_tokens > 0:
                self._need_recv[request.request_id] = _failed_spec("update_state_after_alloc failed")

    def _recv_spec(self, remote: RemotePrefill, local: list[int], awaiting: bool) -> RecvSpec:
        if remote.stream_key is not None:
            if not local:  # nothing to receive (a local hit covers it, or aborted): the worker abandons the stream
                return RecvSpec([], [], remote.request_id, remote.host, remote.port, remote.tp_size, awaiting=False,
                                stream_key=remote.stream_key)
            total = -(-remote.num_tokens // self.block_size)
            # The proxy does not know P's TP size: rank r dials P's rank r, and the hello's layout check
            # refuses a pair whose ranks hold different shards (then D recomputes).
            return RecvSpec(
                local_block_ids=list(local), remote_block_ids=list(range(total - len(local), total)),
                remote_request_id=remote.request_id, remote_host=remote.host, remote_port=remote.port,
                remote_tp_size=self.tp_size, awaiting=awaiting, remote_engine_id=remote.engine_id,
                stream_key=remote.stream_key, remote_num_tokens=remote.num_tokens)
        remote_ids = list(remote.block_ids)
        if local:
            # A local prefix-cache hit covers the leading blocks: fetch the tail.
            remote_ids = remote_ids[-len(local):] if len(local) <= len(remote_ids) else remote_ids
        return RecvSpec(
            local_block_ids=list(local),
            remote_block_ids=remote_ids,
            remote_request_id=remote.request_id,
            remote_host=remote.host,
            remote_port=remote.port,
            remote_tp_size=remote.tp_size,
            awaiting=awaiting,
            remote_engine_id=remote.engine_id,
        )

    # -- prefill side, streaming ---------------------------------------------
    def _open_stream(self, request: Request) -> None:
        """Prefill side: a request scheduled with a stream key streams its KV from this step on."""
        params = request.kv_transfer_params
        if not params or request.request_id in self._streams or request.request_id in self._stream_ended:
            return
        wanted = check_remote_decode(params)
        if wanted is not True:
            return  # declined (logged when it finishes) or not a remote decode
        if self._id_refused(request):
            return
        key = stream_key_of(params)
        if isinstance(key, Declined):
            self._decline(request, key, "serving it without a lease")
            return
        if key is not None:
            self._streams[request.request_id] = (key, request.num_prompt_tokens)

    def _stream_steps(self, out: SchedulerOutput) -> dict[str, StreamStep]:
        """Prefill side: this step's progress of every streamed request it schedules."""
        for rid in out.preempted_req_ids or ():
            gone = self._streams.pop(rid, None)
            if gone is not None:  # its blocks are freed and may be reused by this very step
                self._stream_closes[gone[0]] = "preempted on the prefill engine"
                self._stream_ended.add(rid)
        steps: dict[str, StreamStep] = {}
        if not self._streams:
            return steps
        before: dict[str, int] = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        before.update(zip(cached.req_ids, cached.num_computed_tokens, strict=False))
        state = out.kv_connector_block_state
        for rid, scheduled in out.num_scheduled_tokens.items():
            entry = self._streams.get(rid)
            if entry is None or rid not in before:
                continue
            ids = state.get_block_ids(rid) if state is not None else None
            if not ids:
                continue
            key, num_tokens = entry
            steps[key] = StreamStep(rid, num_tokens, list(ids[0]), before[rid], before[rid] + scheduled)
        return steps

    # -- both -------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: SchedulerOutput | None = None,
                             idle_step: bool = False) -> SocketConnectorMetadata:
        """Hand this step's new fetches, leases and stream progress to the workers
        (``idle_step``: no tokens scheduled)."""
        if scheduler_output is not None:
            idle_step = scheduler_output.total_num_scheduled_tokens == 0
        steps = self._stream_steps(scheduler_output) if scheduler_output is not None else {}
        meta = SocketConnectorMetadata(reqs_to_recv=self._need_recv, reqs_to_send=self._need_send,
                                       idle_step=idle_step, streams=steps, stream_closes=self._stream_closes,
                                       recv_cancels=self._recv_cancels)
        self._need_recv, self._need_send = {}, {}
        self._stream_closes, self._recv_cancels = {}, set()
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Prefill side: keep the blocks and say where to fetch them. Decode side: tidy up."""
        try:
            return self._request_finished(request, block_ids)
        except Exception:
            self._crashed(request, "request_finished", "freeing its blocks now")
            return False, None

    def _request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        if rid in self._streaming_in:  # decode side: stop receiving (a no-op when it is done)
            self._streaming_in.discard(rid)
            self._recv_cancels.add(rid)
        stream = self._streams.pop(rid, None)
        if rid in self._stream_ended:  # preempted mid-stream: its decode engine recomputes, nobody fetches
            self._stream_ended.discard(rid)
            return False, None
        normal = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        if stream is not None and (not normal or not block_ids):
            self._stream_closes[stream[0]] = f"request {request.status.name.lower()} on the prefill engine"
            stream = None
        params = request.kv_transfer_params
        if not params:
            return False, None
        remote = self._remote_prefill(request)
        if remote is not None:
            # Decode request aborted before it was scheduled: free P's lease.
            request.kv_transfer_params["do_remote_prefill"] = False
            self._need_recv[request.request_id] = self._recv_spec(remote, [], awaiting=False)
            return False, None
        wanted = check_remote_decode(request.kv_transfer_params)
        if isinstance(wanted, Declined):
            self._decline(request, wanted, "serving it without a lease")
            return False, None
        if not wanted:
            return False, None
        if not normal:
            return False, None
        if not self.is_producer or self.settings.port is None:
            logger.warning("socket KV connector: request %s asks for remote decode but this engine "
                           "has no listener port (kv_role must be kv_producer)", request.request_id)
            return False, None
        if self._id_refused(request):
            if stream is not None:
                self._stream_closes[stream[0]] = "request id refused"
            return False, None
        out = {
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
        delay = bool(block_ids)
        if delay:  # last: nothing may fail between registering the lease and telling vLLM to keep the blocks
            self._need_send[request.request_id] = SendSpec(list(block_ids), self.settings.lease_s,
                                                           stream[0] if stream is not None else None)
        return delay, out


def _failed_spec(why: str) -> RecvSpec:
    """A fetch the worker reports failed at once (vLLM recomputes), contacting no one."""
    return RecvSpec(local_block_ids=[], remote_block_ids=[], remote_request_id="", remote_host="", remote_port=0,
                    remote_tp_size=1, awaiting=True, failure=f"socket KV connector: {why}")
