"""The scheduler half's bookkeeping, with stand-in requests (no engine)."""

from __future__ import annotations

from types import SimpleNamespace

from disagg_connectors.socket_connector.config import SocketSettings
from disagg_connectors.socket_connector.scheduler import SocketScheduler
from vllm.v1.request import RequestStatus

ENV = {"DISAGG_KV_SECRET": "k" * 64}
VLLM_CONFIG = SimpleNamespace(cache_config=SimpleNamespace(block_size=16),
                              parallel_config=SimpleNamespace(tensor_parallel_size=1))


def scheduler(producer: bool) -> SocketScheduler:
    extra = {"host": "198.18.0.1", "port": 5601, "kv_lease_duration": 9} if producer else {}
    return SocketScheduler(VLLM_CONFIG, "engine-p", SocketSettings.load(extra, ENV))


def request(params: dict | None, prompt_len: int = 40, status=RequestStatus.RUNNING, computed: int = 0):
    return SimpleNamespace(request_id="req-1", kv_transfer_params=params, num_prompt_tokens=prompt_len,
                           status=status, num_computed_tokens=computed)


def blocks(ids: list[int]):
    return SimpleNamespace(get_unhashed_block_ids=lambda: list(ids))


def test_prefill_keeps_blocks_and_names_its_listener() -> None:
    s = scheduler(producer=True)
    req = request({"do_remote_decode": True}, status=RequestStatus.FINISHED_LENGTH_CAPPED, computed=40)
    delay, params = s.request_finished(req, [7, 8, 9])
    assert delay is True
    assert params is not None
    assert {k: params[k] for k in ("do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
                                   "remote_request_id", "remote_host", "remote_port", "remote_num_tokens")} == {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [7, 8, 9],
        "remote_engine_id": "engine-p", "remote_request_id": "req-1", "remote_host": "198.18.0.1",
        "remote_port": 5601, "remote_num_tokens": 40}
    meta = s.build_connector_meta()
    assert meta.reqs_to_send["req-1"].block_ids == [7, 8, 9] and meta.reqs_to_send["req-1"].ttl_s == 9
    assert s.build_connector_meta().reqs_to_send == {}  # handed over once
    assert not meta.idle_step and s.build_connector_meta(idle_step=True).idle_step


def test_aborted_prefill_frees_at_once() -> None:
    s = scheduler(producer=True)
    req = request({"do_remote_decode": True}, status=RequestStatus.FINISHED_ABORTED)
    assert s.request_finished(req, [1]) == (False, None)
    assert s.build_connector_meta().reqs_to_send == {}


def remote_params(blocks_: list[int], tokens: int = 40) -> dict:
    return {"do_remote_prefill": True, "remote_block_ids": blocks_, "remote_request_id": "p-req",
            "remote_host": "198.18.0.1", "remote_port": 5601, "remote_num_tokens": tokens, "tp_size": 1,
            "remote_engine_id": "engine-p"}


def test_decode_loads_the_prompt_asynchronously_and_fetches_the_tail() -> None:
    s = scheduler(producer=False)
    req = request(remote_params([7, 8, 9]), prompt_len=40)
    assert s.get_num_new_matched_tokens(req, 0) == (40, True)
    assert s.get_num_new_matched_tokens(req, 16) == (24, True)  # side-effect free, local hit aware
    s.update_state_after_alloc(req, blocks([3, 4]), 24)  # first block hit the local cache
    spec = s.build_connector_meta().reqs_to_recv["req-1"]
    assert (spec.local_block_ids, spec.remote_block_ids, spec.awaiting) == ([3, 4], [8, 9], True)
    assert (spec.remote_host, spec.remote_port, spec.remote_request_id) == ("198.18.0.1", 5601, "p-req")
    assert req.kv_transfer_params["do_remote_prefill"] is False  # one transfer per request
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)


def test_full_local_hit_only_releases_the_lease() -> None:
    s = scheduler(producer=False)
    req = request(remote_params([7, 8, 9]))
    s.update_state_after_alloc(req, blocks([]), 0)
    spec = s.build_connector_meta().reqs_to_recv["req-1"]
    assert spec.local_block_ids == [] and spec.awaiting is False


def test_decode_request_aborted_before_scheduling_releases_the_lease() -> None:
    s = scheduler(producer=False)
    req = request(remote_params([7]), status=RequestStatus.FINISHED_ABORTED)
    assert s.request_finished(req, []) == (False, None)
    spec = s.build_connector_meta().reqs_to_recv["req-1"]
    assert spec.awaiting is False and spec.remote_request_id == "p-req"


def test_plain_requests_are_untouched() -> None:
    s = scheduler(producer=False)
    req = request(None)
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    assert s.request_finished(req, [1]) == (False, None)
    incomplete = request({"do_remote_prefill": True, "remote_host": "x"})
    assert s.get_num_new_matched_tokens(incomplete, 0) == (0, False)
