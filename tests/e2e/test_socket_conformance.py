"""The conformance suite against a 1P1D with our socket KV connector (`connector: socket`), the KV
fetched after the prefill and streamed while it runs.

Both run on the session's shared socket deployment (tests/e2e/shared_deployment.py): `disagg up
--detach` of the fetching topology, whose engines the streamed handoff shares through a proxy of
its own (``connector.streaming`` is the proxy's setting: harness/own_proxy.py checks that the
engines would start alike), as tests/e2e/test_socket_routing_auto.py does for routing ``auto``.
That module runs first; this one takes the deployment down in its last test (`disagg down`).
Of the conformance cases, only those the KV handoff serves run here (``HANDOFF_CASES``; the NIXL
1P1D runs them all). The deployment comes up once test_pd.py's last test stopped the session's
NIXL deployment; if that did not happen (test_pd not selected), the fixture stops it, and it
refuses to start while any other engine on the session's model still runs (never more than two
engines at once).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from disagg.prompts import exact_prompt
from disagg.proxy.admission import REQUEST_ID_REPLACED
from harness.engines import ENGINE_KEY, Running, plain_answer
from harness.own_proxy import own_topology, start_own_proxy
from tests.e2e.conformance import HANDOFF_CASES, KV_CASE, Recorded, check_case, check_kv_batch
from tests.e2e.crafted import EVIL_KV, Crafted, cases, engines_idle_and_alive, send
from tests.e2e.front_door import (
    idle_strangers,
    kv_batch_problems,
    prefill_kv_port,
    stalled_stream_batch,
    unserved_paths_reaching_engines,
)
from tests.e2e.shared_deployment import SEND_TIMEOUT_S, SOCKET, SharedDeployment, socket_deployment

pytestmark = pytest.mark.e2e
#: the session's shared deployment this module uses, and takes down (tests/e2e/conftest.py)
SHARED_DEPLOYMENT = SOCKET
TAKES_DOWN_SHARED = "test_down_leaves_nothing"


@pytest.fixture(scope="module", params=["stream", "fetch"])
def socket_pd(request: pytest.FixtureRequest, conformance_reference: dict[str, Recorded], e2e_dir: Path,
              tiny_model: Path, shared_deployment: SharedDeployment) -> Iterator[Running]:
    """The socket 1P1D with the KV streamed while the prefill runs (the shared engines behind a
    proxy of this module's own, ``streaming: true``), then fetched after it (the shared deployment
    as `disagg up` started it, whose last test takes it down)."""
    run = socket_deployment(shared_deployment, e2e_dir, tiny_model)
    if request.param == "fetch":
        yield run
        return
    own = start_own_proxy(run, own_topology(run, e2e_dir / "pd-socket-stream.yaml",
                                            {"connector": {"streaming": True}}))
    try:
        yield own
    finally:
        assert own.stop() == []


@pytest.fixture(scope="module")
def socket_engines(conformance_reference: dict[str, Recorded], e2e_dir: Path, tiny_model: Path,
                   shared_deployment: SharedDeployment) -> Running:
    """The shared socket deployment, for the tests that go straight to its engines (both handoffs
    use the same two: such a test runs once)."""
    return socket_deployment(shared_deployment, e2e_dir, tiny_model)


def test_deployment_uses_the_socket_connector(socket_pd: Running) -> None:
    assert set(socket_pd.engines) == {"prefill[0]", "decode[0]"}
    assert "socket" in socket_pd.topology.read_text()
    streaming = "streaming: true" in socket_pd.topology.read_text()
    cmdlines = [" ".join(p.cmdline()) for p in socket_pd.process_tree()]
    proxy = [c for c in cmdlines if " disagg proxy " in f" {c} " or "-m disagg proxy" in c]
    assert proxy, cmdlines
    assert ("--handoff vllm-socket-stream" in proxy[0]) == streaming, proxy[0]


def test_batched_request_moves_every_prompts_kv(socket_pd: Running,
                                                conformance_reference: dict[str, Recorded]) -> None:
    check_kv_batch(socket_pd.proxy_url, socket_pd.engines["decode[0]"], conformance_reference[KV_CASE], "socket")


@pytest.mark.parametrize("name", HANDOFF_CASES)
def test_answers_like_one_vllm_server(socket_pd: Running, conformance_reference: dict[str, Recorded],
                                      name: str) -> None:
    check_case(socket_pd.proxy_url, name, conformance_reference[name])


CRAFTED = cases()

#: crafted requests that a keyed client gets a 500 for from vLLM's own API server (not the connector),
#: the engine unharmed; the proxy never sends them (it strips what makes them fail)
VLLM_API_500 = {
    "kv-in-vllm-xargs": "vLLM's output processor calls .get() on a non-object vllm_xargs.kv_transfer_params",
}


@pytest.mark.parametrize("case", CRAFTED, ids=[c.name for c in CRAFTED])
def test_crafted_input_gets_a_clear_answer(socket_pd: Running, case: Crafted) -> None:
    """To the proxy (each handoff): its answer; the engines stay idle and alive."""
    answer = send(socket_pd.proxy_url, case)
    assert answer.status in case.proxy_status, (case.name, answer.status, answer.body[:300])
    assert engines_idle_and_alive(socket_pd.engines) == [], case.name


@pytest.mark.parametrize("case", CRAFTED, ids=[c.name for c in CRAFTED])
def test_crafted_input_straight_to_an_engine(socket_engines: Running, case: Crafted) -> None:
    """Straight to each engine without the key: refused. With the key (a stand-in for a client past
    the key): never a 5xx, the connector declines bad params. Once: both handoffs share the engines."""
    for name, url in socket_engines.engines.items():
        direct = send(url, case)
        assert direct.status in case.engine_status, (case.name, name, direct.status, direct.body[:300])
        keyed = send(url, case, key=ENGINE_KEY)
        assert keyed.status < 500 or case.name in VLLM_API_500, (case.name, name, keyed.status, keyed.body[:300])
        assert engines_idle_and_alive({name: url}) == [], (case.name, name)


def test_crafted_kv_params_with_the_key_are_declined_by_decode(socket_engines: Running) -> None:
    """The engine key let it through; the connector's validation declines it and decode computes."""
    decode = socket_engines.engines["decode[0]"]
    for params in (EVIL_KV, {**EVIL_KV, "remote_port": "not-a-port"}, {**EVIL_KV, "remote_block_ids": [-1]}):
        case = Crafted("keyed", "/v1/completions",
                       json.dumps({"model": "tiny", "prompt": "The river runs past the mill and", "max_tokens": 4,
                                   "temperature": 0, "kv_transfer_params": params}).encode(), frozenset({200}))
        answer = send(decode, case, key=ENGINE_KEY)
        assert answer.status == 200, (params, answer.status, answer.body[:300])
        assert json.loads(answer.body)["choices"][0]["finish_reason"] == "length"


def test_prefill_engine_serves_a_plain_request_alone(socket_engines: Running,
                                                    reference: dict[str, str],
                                                    requests_: dict[str, dict]) -> None:
    """The routing's ``whole`` path: a kv_producer prefill engine with the socket connector answers
    the client's own request (no kv_transfer_params) like one vLLM server, streamed or not."""
    for name in ("socket-whole-completion", "socket-whole-chat"):
        assert plain_answer(socket_engines.engines["prefill[0]"], requests_[name]) == reference[name]
    streamed = {**requests_["socket-whole-stream"], "stream": True}
    assert plain_answer(socket_engines.engines["prefill[0]"], streamed) == reference["socket-whole-stream"]


def test_no_dot_segment_or_unserved_path_reaches_an_engine(socket_pd: Running) -> None:
    statuses, reached = unserved_paths_reaching_engines(socket_pd)
    assert set(statuses.values()) <= {404, 405}, statuses
    assert reached == 0, f"the engines' request counters grew by {reached:.0f}"


def test_idle_strangers_do_not_lock_decode_out_of_the_kv_listener(socket_pd: Running, tokenizer: Tokenizer) -> None:
    """32 idle connections from another address sit on prefill's KV listener (more than its whole
    pre-authentication budget once was); every prompt's KV still moves to decode."""
    mode = "stream" if "streaming: true" in socket_pd.topology.read_text() else "fetch"
    strangers = idle_strangers(prefill_kv_port(socket_pd), 32)
    try:
        tokens = [64, 96, 128]
        prompts = [exact_prompt(tokenizer, n, f"flood-{mode}-{i}") for i, n in enumerate(tokens)]
        status, _, problems = kv_batch_problems(socket_pd, prompts, tokens)
    finally:
        for s in strangers:
            s.close()
    assert status == 200 and problems == [], problems


def test_a_bad_client_request_id_is_replaced_and_the_kv_still_moves(socket_pd: Running,
                                                                    tokenizer: Tokenizer) -> None:
    mode = "stream" if "streaming: true" in socket_pd.topology.read_text() else "fetch"
    for n, given in enumerate(("x" * 600, "tab\there")):
        tokens = [72, 80]
        prompts = [exact_prompt(tokenizer, t, f"rid-{mode}-{n}-{i}") for i, t in enumerate(tokens)]
        status, headers, problems = kv_batch_problems(socket_pd, prompts, tokens, {"X-Request-Id": given})
        assert status == 200 and problems == [], (given[:20], problems)
        assert REQUEST_ID_REPLACED in headers and headers["X-Request-Id"] != given


def test_a_client_that_stops_reading_a_streamed_batch_is_let_go(socket_pd: Running) -> None:
    """The client sends a streamed batch and reads nothing: once the proxy's buffers towards it are
    full, the proxy waits timeouts.send and lets go: its slots are free, the client's connection
    closed, any engine request still generating aborted, and the proxy's memory stays put."""
    got = stalled_stream_batch(socket_pd, prompts=4, max_tokens=8000, wait_s=120)
    assert got.let_go_s is not None, f"the proxy still held the stalled client's slots after 120 s: {got}"
    assert got.closed, got
    assert got.rss_growth_mib < 50, got
    assert engines_idle_and_alive(socket_pd.engines) == []
    print(f"\nstalled streamed batch: let go after {got.let_go_s:.1f} s (send timeout {SEND_TIMEOUT_S} s), "
          f"{got.aborted:.0f} of 4 engine requests aborted, proxy RSS +{got.rss_growth_mib:.0f} MiB")


def test_engines_alive_and_idle_after_crafted_inputs(socket_pd: Running) -> None:
    assert engines_idle_and_alive(socket_pd.engines) == []


def test_down_leaves_nothing(socket_engines: Running, shared_deployment: SharedDeployment) -> None:
    """`disagg down` of the shared deployment leaves nothing of it: processes, ports, state file,
    engines (the streamed handoff's own proxy was stopped and checked gone at its fixture's end)."""
    assert shared_deployment.run is socket_engines
    assert shared_deployment.release() == []
