"""The scheduler half's bookkeeping, with stand-in requests (no engine).

Also: no hook raises on client input, and a request whose kv_transfer_params
are declined gets exactly one warning, no fetch and no lease.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from disagg_connectors.socket_connector.config import SocketSettings
from disagg_connectors.socket_connector.leases import LeaseTable
from disagg_connectors.socket_connector.params import (
    MAX_REQUEST_ID_CHARS,
    AllowedPeers,
    Declined,
    check_remote_prefill,
)
from disagg_connectors.socket_connector.scheduler import SocketScheduler
from disagg_connectors.socket_connector.server import KVServer
from vllm.v1.request import RequestStatus

ENV = {"DISAGG_KV_SECRET": "k" * 64}
VLLM_CONFIG = SimpleNamespace(cache_config=SimpleNamespace(block_size=16),
                              parallel_config=SimpleNamespace(tensor_parallel_size=1))
PEER = "198.18.0.1:5601"


def scheduler(producer: bool, peers: list[str] | None = None) -> SocketScheduler:
    if producer:
        extra: dict = {"host": "198.18.0.1", "port": 5601, "kv_lease_duration": 9}
    else:
        extra = {"peers": [PEER] if peers is None else peers}
    return SocketScheduler(VLLM_CONFIG, "engine-p", SocketSettings.load(extra, ENV), is_producer=producer)


def request(params: dict | None, prompt_len: int = 40, status=RequestStatus.RUNNING, computed: int = 0):
    return SimpleNamespace(request_id="req-1", kv_transfer_params=params, num_prompt_tokens=prompt_len,
                           status=status, num_computed_tokens=computed)


def blocks(ids: list[int]):
    return SimpleNamespace(get_unhashed_block_ids=lambda: list(ids))


@pytest.fixture
def warnings() -> Iterator[list[logging.LogRecord]]:
    """Warnings of the scheduler half (its logger may not propagate under vLLM's logging setup)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    log = logging.getLogger("disagg_connectors.socket_connector.scheduler")
    log.addHandler(handler)
    yield records
    log.removeHandler(handler)


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


def test_what_the_prefill_side_produces_passes_the_decode_side() -> None:
    """P's params, forwarded verbatim (plus what vLLM adds), are accepted by a D that names P as a peer."""
    p, d = scheduler(producer=True), scheduler(producer=False)
    for prompt_len in (1, 16, 17, 40):
        n_blocks = -(-prompt_len // 16)
        done = request({"do_remote_decode": True, "do_remote_prefill": False, "remote_host": None,
                        "remote_port": None, "remote_block_ids": None, "remote_engine_id": None},
                       prompt_len=prompt_len, status=RequestStatus.FINISHED_LENGTH_CAPPED, computed=prompt_len)
        _, params = p.request_finished(done, list(range(10, 10 + n_blocks)))
        assert params is not None
        params["remote_prefill_cached_tokens"] = 0  # vLLM's scheduler adds this on P
        req = request(params, prompt_len=prompt_len)
        assert d.get_num_new_matched_tokens(req, 0) == (prompt_len, True)


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
    assert spec.failure is None
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
    req = request(remote_params([7, 8, 9]), status=RequestStatus.FINISHED_ABORTED)
    assert s.request_finished(req, []) == (False, None)
    spec = s.build_connector_meta().reqs_to_recv["req-1"]
    assert spec.awaiting is False and spec.remote_request_id == "p-req"


def test_plain_requests_are_untouched(warnings) -> None:
    s = scheduler(producer=False)
    req = request(None)
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    assert s.request_finished(req, [1]) == (False, None)
    assert s.get_num_new_matched_tokens(request({}), 0) == (0, False)
    assert s.get_num_new_matched_tokens(request({"do_remote_prefill": False}), 0) == (0, False)
    assert warnings == []


# -- declined params: one line, no fetch, nothing raised ------------------------

CRAFTED = {
    "port-not-a-port": {"remote_port": "not-a-port"},
    "host-not-a-peer": {"remote_host": "198.18.0.9"},
    "flag-a-string": {"do_remote_prefill": "yes"},
    "too-many-blocks": {"remote_block_ids": [7, 8, 9, 10]},
    "negative-block": {"remote_block_ids": [7, -8, 9]},
    "string-blocks": {"remote_block_ids": ["7", "8", "9"]},
    "huge-tp": {"tp_size": 10**12},
    "missing-request-id": {"remote_request_id": None},
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_crafted_params_are_declined_once_through_every_decode_hook(case: str, warnings) -> None:
    s = scheduler(producer=False)
    req = request({**remote_params([7, 8, 9]), **CRAFTED[case]})
    field = next(iter(CRAFTED[case]))
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)  # asked again: still no load, no new line
    s.update_state_after_alloc(req, blocks([]), 0)
    assert s.request_finished(req, []) == (False, None)
    assert s.build_connector_meta().reqs_to_recv == {}  # nothing fetched, nobody contacted
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    line = warnings[0].getMessage()
    assert "req-1" in line and field in line and "declining" in line
    assert "198.18.0.1" not in line or field == "remote_host"  # the field, not the whole dict


def test_declined_at_abort_logs_once_and_releases_nothing(warnings) -> None:
    s = scheduler(producer=False)
    req = request({**remote_params([7, 8, 9]), "remote_port": 0}, status=RequestStatus.FINISHED_ABORTED)
    assert s.request_finished(req, []) == (False, None)
    assert s.build_connector_meta().reqs_to_recv == {}
    assert len(warnings) == 1 and "remote_port" in warnings[0].getMessage()


def test_without_peers_only_loopback_prefill_engines_are_fetched_from(warnings) -> None:
    s = scheduler(producer=False, peers=[])
    local = request({**remote_params([7, 8, 9]), "remote_host": "127.0.0.1", "remote_port": 40000})
    assert s.get_num_new_matched_tokens(local, 0) == (40, True)
    remote = request(remote_params([7, 8, 9]))  # 198.18.0.1
    assert s.get_num_new_matched_tokens(remote, 0) == (0, False)
    assert len(warnings) == 1 and "not an allowed prefill peer" in warnings[0].getMessage()


def test_prefill_with_bad_remote_decode_flags_is_served_without_a_lease(warnings) -> None:
    s = scheduler(producer=True)
    for params in ({"do_remote_decode": "yes"}, {"do_remote_decode": True, "do_remote_prefill": True},
                   {"do_remote_decode": 1}):
        req = request(dict(params), status=RequestStatus.FINISHED_LENGTH_CAPPED, computed=40)
        assert s.get_num_new_matched_tokens(req, 0) == (0, False)  # a prefill engine never loads
        assert s.request_finished(req, [7, 8, 9]) == (False, None)
    assert s.build_connector_meta().reqs_to_send == {}
    assert len(warnings) == 3, [r.getMessage() for r in warnings]


def test_remote_prefill_sent_to_a_prefill_engine_is_computed_there(warnings) -> None:
    """A producer has no fetch pool: a load promised there would wait for ever."""
    s = scheduler(producer=True)
    req = request(remote_params([7, 8, 9]))
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    s.update_state_after_alloc(req, blocks([1, 2, 3]), 0)
    assert s.build_connector_meta().reqs_to_recv == {}
    assert len(warnings) == 1 and "kv_producer" in warnings[0].getMessage()


def test_a_crashing_hook_declines_instead_of_raising(warnings) -> None:
    class Exploding(SimpleNamespace):
        @property
        def num_prompt_tokens(self) -> int:
            raise RuntimeError("boom")

    s = scheduler(producer=False)
    req = Exploding(request_id="req-9", kv_transfer_params=remote_params([7, 8, 9]),
                    status=RequestStatus.RUNNING, num_computed_tokens=0)
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    assert req.kv_transfer_params["do_remote_prefill"] is False  # inert from now on
    assert s.request_finished(req, []) == (False, None)
    assert any("req-9" in r.getMessage() for r in warnings)


def test_a_load_promised_then_failing_is_reported_failed_not_left_waiting() -> None:
    s = scheduler(producer=False)
    req = request(remote_params([7, 8, 9]))
    assert s.get_num_new_matched_tokens(req, 0) == (40, True)

    def broken():
        raise RuntimeError("allocator changed its mind")

    s.update_state_after_alloc(req, SimpleNamespace(get_unhashed_block_ids=broken), 40)
    spec = s.build_connector_meta().reqs_to_recv["req-1"]
    assert spec.awaiting is True and spec.failure  # the worker reports it failed; vLLM recomputes


# -- request ids: the prefill side leases only what the decode side would fetch -----

#: ids vLLM could hand the prefill engine (a client's X-Request-Id with vLLM's affixes) that the decode
#: side refuses; and their boundary twins it accepts
REFUSED_IDS = ["cmpl-" + "r" * MAX_REQUEST_ID_CHARS, "cmpl-a b-0", "cmpl-a\tb-0", "cmpl-\u00e9t\u00e9-0",
               "cmpl-\x1b[2J-0"]
ACCEPTED_IDS = ["r" * MAX_REQUEST_ID_CHARS, "cmpl-" + "x" * 128 + "-0-1a2b3c4d"]


def decode_refuses(rid: str) -> bool:
    """Whether the decode side turns down a prefill reply naming ``rid``: its scheduler's check of
    ``remote_request_id`` and its listener's check of a fetch's request id."""
    params = {"do_remote_prefill": True, "remote_block_ids": [7], "remote_request_id": rid,
              "remote_host": "198.18.0.1", "remote_port": 5601, "remote_num_tokens": 16}
    declined = isinstance(check_remote_prefill(params, num_prompt_tokens=16, block_size=16,
                                               peers=AllowedPeers.parse([PEER])), Declined)
    assert declined is not KVServer._valid_request_id(rid)  # both decode-side checks agree
    return declined


@pytest.mark.parametrize("rid", REFUSED_IDS + ACCEPTED_IDS)
def test_prefill_takes_no_lease_for_an_id_the_decode_side_refuses(warnings, rid: str) -> None:
    s = scheduler(producer=True)
    req = request({"do_remote_decode": True}, prompt_len=16, status=RequestStatus.FINISHED_LENGTH_CAPPED,
                  computed=16)
    req.request_id = rid
    s.update_state_after_alloc(req, blocks([]), 0)      # its first schedule: checked before any lease or stream
    delay, params = s.request_finished(req, [7])
    leases = LeaseTable()
    for lease_rid, send in s.build_connector_meta().reqs_to_send.items():  # what the worker would lease
        leases.register(lease_rid, send.block_ids, send.ttl_s)
    if decode_refuses(rid):
        assert (delay, params) == (False, None)         # vLLM frees the blocks now
        assert len(leases) == 0
        assert s.refused_request_ids == 1
        assert len(warnings) == 1 and "keeping no lease" in warnings[0].getMessage()
        assert len(warnings[0].getMessage()) < 400      # the id is quoted short, not logged whole
    else:
        assert delay is True and params is not None and params["remote_request_id"] == rid
        assert len(leases) == 1 and s.refused_request_ids == 0 and warnings == []


def test_a_streamed_request_with_a_refused_id_is_neither_streamed_nor_leased(warnings) -> None:
    s = scheduler(producer=True)
    req = request({"do_remote_decode": True, "stream_key": "s" * 32}, prompt_len=16)
    req.request_id = "cmpl-a b-0"
    s.update_state_after_alloc(req, blocks([]), 0)
    out = SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id=req.request_id, num_computed_tokens=0)],
                          scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
                          num_scheduled_tokens={req.request_id: 16}, total_num_scheduled_tokens=16,
                          kv_connector_block_state=SimpleNamespace(get_block_ids=lambda r: ([7],)),
                          preempted_req_ids=None)
    assert s.build_connector_meta(out).streams == {}
    req.status, req.num_computed_tokens = RequestStatus.FINISHED_LENGTH_CAPPED, 16
    assert s.request_finished(req, [7]) == (False, None)
    assert s.build_connector_meta().reqs_to_send == {}
    assert s.refused_request_ids == 1 and len(warnings) == 1
