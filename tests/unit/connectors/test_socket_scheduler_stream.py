"""The scheduler half's streamed transfers, with stand-in requests and scheduler outputs (no engine)."""

from __future__ import annotations

from types import SimpleNamespace

from disagg_connectors.socket_connector.params import AllowedPeers, Declined, check_remote_prefill, stream_key_of
from vllm.v1.request import RequestStatus

from tests.unit.connectors.test_socket_scheduler import PEER, blocks, request, scheduler

KEY = "s" * 32
P_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "stream_key": KEY}
D_PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "transfer": "socket", "stream_key": KEY,
            "remote_host": "198.18.0.1", "remote_port": 5601}


def output(new: dict[str, int] | None = None, cached: dict[str, int] | None = None,
           scheduled: dict[str, int] | None = None, block_ids: dict[str, list[int]] | None = None,
           preempted: set[str] | None = None):
    """A stand-in SchedulerOutput: ``new``/``cached`` map request ids to tokens computed before the step."""
    new, cached, scheduled, block_ids = new or {}, cached or {}, scheduled or {}, block_ids or {}
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=n) for r, n in new.items()],
        scheduled_cached_reqs=SimpleNamespace(req_ids=list(cached), num_computed_tokens=list(cached.values())),
        num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
        kv_connector_block_state=SimpleNamespace(get_block_ids=lambda r: (block_ids[r],) if r in block_ids else None),
        preempted_req_ids=preempted)


def test_prefill_reports_each_steps_progress_of_a_streamed_request() -> None:
    s = scheduler(producer=True)
    req = request(dict(P_PARAMS), prompt_len=70)
    s.update_state_after_alloc(req, blocks([]), 0)
    meta = s.build_connector_meta(output(new={"req-1": 32}, scheduled={"req-1": 16}, block_ids={"req-1": [4, 5, 6]}))
    step = meta.streams[KEY]
    assert (step.request_id, step.num_tokens, step.block_ids, step.ready_before, step.ready_after) == (
        "req-1", 70, [4, 5, 6], 32, 48)
    meta = s.build_connector_meta(output(cached={"req-1": 48}, scheduled={"req-1": 22},
                                         block_ids={"req-1": [4, 5, 6, 7, 8]}))
    assert (meta.streams[KEY].ready_before, meta.streams[KEY].ready_after, meta.streams[KEY].block_ids) == (
        48, 70, [4, 5, 6, 7, 8])
    assert s.build_connector_meta(output()).streams == {}    # not scheduled: nothing to report
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, params = s.request_finished(req, [4, 5, 6, 7, 8])
    assert delay is True and params is not None
    send = s.build_connector_meta(output()).reqs_to_send["req-1"]
    assert send.stream_key == KEY and send.block_ids == [4, 5, 6, 7, 8]


def test_an_aborted_or_preempted_prefill_ends_its_stream_before_the_next_forward() -> None:
    s = scheduler(producer=True)
    req = request(dict(P_PARAMS), prompt_len=70)
    s.update_state_after_alloc(req, blocks([]), 0)
    meta = s.build_connector_meta(output(preempted={"req-1"}, scheduled={"req-1": 16},
                                         block_ids={"req-1": [1]}, new={"req-1": 0}))
    assert meta.stream_closes == {KEY: "preempted on the prefill engine"} and meta.streams == {}
    s.update_state_after_alloc(req, blocks([]), 0)           # resumed: its stream is over, not opened again
    assert s.build_connector_meta(output(cached={"req-1": 0}, scheduled={"req-1": 16},
                                         block_ids={"req-1": [1]})).streams == {}
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED        # and no lease: its decode engine recomputed
    assert s.request_finished(req, [1]) == (False, None)
    assert s.build_connector_meta(output()).reqs_to_send == {}
    other = request(dict(P_PARAMS), prompt_len=70)
    other.request_id = "req-2"
    s.update_state_after_alloc(other, blocks([]), 0)
    other.status = RequestStatus.FINISHED_ABORTED
    assert s.request_finished(other, [1, 2]) == (False, None)
    meta = s.build_connector_meta(output())
    assert list(meta.stream_closes) == [KEY] and "aborted" in meta.stream_closes[KEY]
    assert meta.reqs_to_send == {}


def test_decode_streams_into_its_blocks_and_cuts_the_stream_when_aborted() -> None:
    s = scheduler(producer=False, peers=["198.18.0.1:5601"])
    req = request(dict(D_PARAMS), prompt_len=70)
    assert s.get_num_new_matched_tokens(req, 16) == (54, True)  # one block of its own prefix cache
    s.update_state_after_alloc(req, blocks([7, 8, 9, 10]), 54)
    spec = s.build_connector_meta(output()).reqs_to_recv["req-1"]
    assert (spec.stream_key, spec.remote_num_tokens, spec.local_block_ids, spec.remote_block_ids) == (
        KEY, 70, [7, 8, 9, 10], [1, 2, 3, 4])
    req.status = RequestStatus.FINISHED_ABORTED
    s.request_finished(req, [7, 8, 9, 10])
    assert s.build_connector_meta(output()).recv_cancels == {"req-1"}


def test_stream_params_are_checked() -> None:
    peers = AllowedPeers.parse(PEER)
    ok = check_remote_prefill(D_PARAMS, num_prompt_tokens=70, block_size=16, peers=peers)
    assert not isinstance(ok, Declined) and ok is not None and ok.stream_key == KEY and ok.num_tokens == 70
    for bad, field in [({"stream_key": "x"}, "stream_key"), ({"stream_key": KEY + " "}, "stream_key"),
                       ({"remote_block_ids": [1, 2, 3, 4, 5]}, "remote_block_ids"),
                       ({"remote_num_tokens": 69}, "remote_num_tokens"),
                       ({"remote_num_tokens": True}, "remote_num_tokens")]:
        declined = check_remote_prefill({**D_PARAMS, **bad}, num_prompt_tokens=70, block_size=16, peers=peers)
        assert isinstance(declined, Declined) and declined.field == field, bad
    assert stream_key_of({}) is None and stream_key_of({"stream_key": None}) is None
    assert isinstance(stream_key_of({"stream_key": 12345678901234567890}), Declined)


def test_a_decode_request_aborted_before_its_stream_started_abandons_it() -> None:
    """D's request ends before vLLM scheduled it: its worker tells P it will never read the stream
    (a release of a streamed plan is op ``abandon``), so P's lease ends at once."""
    s = scheduler(producer=False, peers=["198.18.0.1:5601"])
    req = request(dict(D_PARAMS), prompt_len=70, status=RequestStatus.FINISHED_ABORTED)
    assert s.request_finished(req, []) == (False, None)
    spec = s.build_connector_meta(output()).reqs_to_recv["req-1"]
    assert (spec.stream_key, spec.awaiting, spec.local_block_ids) == (KEY, False, [])


def test_the_decode_worker_releases_a_stream_it_will_not_read() -> None:
    from disagg_connectors.socket_connector.config import SocketSettings
    from disagg_connectors.socket_connector.metadata import RecvSpec
    from disagg_connectors.socket_connector.worker import SocketWorker

    worker = SocketWorker(SocketSettings.load({}, {"DISAGG_KV_SECRET": "k" * 64}), "d", False, 0, 1, 64)
    released = []
    worker._conns = SimpleNamespace(release=released.append)  # type: ignore[assignment]
    worker._run_fetch("req-1", RecvSpec([], [], "", "198.18.0.1", 5601, 1, awaiting=False, stream_key=KEY))
    assert [(p.stream_key, p.host, p.port) for p in released] == [(KEY, "198.18.0.1", 5601)]
