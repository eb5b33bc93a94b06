"""Issue 13's conformance suite against a 1P1D with our socket KV connector (`connector: socket`).

The deployment is this module's own (`disagg up --detach`, `disagg down` in the last test). It
sorts after test_pd.py, whose last test stops the session's NIXL deployment; if that did not
happen (test_pd not selected), the fixture stops it, and it refuses to start while any other
engine on the session's model still runs (never more than two engines at once).
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.e2e.conformance import CASE_NAMES, KV_CASE, Recorded, check_case, check_kv_batch
from tests.e2e.crafted import EVIL_KV, Crafted, cases, engines_idle_and_alive, send
from tests.e2e.engines import (
    ENGINE_KEY,
    SPLIT_EVERY_PROMPT,
    Running,
    bring_up_socket_pd,
    busy_ports,
    engine_processes,
    foreground_up_processes,
    plain_answer,
)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module", params=["fetch", "stream"])
def socket_pd(request: pytest.FixtureRequest, conformance_reference: dict[str, Recorded], e2e_dir: Path,
              tiny_model: Path) -> Iterator[Running]:
    """1 prefill + 1 decode with the socket connector over loopback behind the proxy: the KV fetched
    after the prefill, then (a deployment of its own) streamed while it runs."""
    for up in foreground_up_processes(e2e_dir / "pd.yaml"):  # the NIXL `pd`, if test_pd did not stop it
        up.send_signal(signal.SIGINT)
        up.wait(timeout=120)
    streaming = request.param == "stream"
    run = bring_up_socket_pd(e2e_dir, tiny_model, f"pd-socket-{request.param}", extra=SPLIT_EVERY_PROMPT,
                             streaming=streaming)
    try:
        yield run
    finally:  # test_down_leaves_nothing normally did this already
        if (run.run_dir / "runs" / run.topology.stem / "state.json").exists():
            run.down()


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


@pytest.mark.parametrize("name", CASE_NAMES)
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
    """To the proxy: its answer; straight to each engine without the key: refused. With the key
    (a stand-in for a client past the key): never a 5xx, the connector declines bad params."""
    answer = send(socket_pd.proxy_url, case)
    assert answer.status in case.proxy_status, (case.name, answer.status, answer.body[:300])
    for name, url in socket_pd.engines.items():
        direct = send(url, case)
        assert direct.status in case.engine_status, (case.name, name, direct.status, direct.body[:300])
        keyed = send(url, case, key=ENGINE_KEY)
        assert keyed.status < 500 or case.name in VLLM_API_500, (case.name, name, keyed.status, keyed.body[:300])
        assert engines_idle_and_alive({name: url}) == [], (case.name, name)


def test_crafted_kv_params_with_the_key_are_declined_by_decode(socket_pd: Running) -> None:
    """The engine key let it through; the connector's validation declines it and decode computes."""
    decode = socket_pd.engines["decode[0]"]
    for params in (EVIL_KV, {**EVIL_KV, "remote_port": "not-a-port"}, {**EVIL_KV, "remote_block_ids": [-1]}):
        case = Crafted("keyed", "/v1/completions",
                       json.dumps({"model": "tiny", "prompt": "The river runs past the mill and", "max_tokens": 4,
                                   "temperature": 0, "kv_transfer_params": params}).encode(), frozenset({200}))
        answer = send(decode, case, key=ENGINE_KEY)
        assert answer.status == 200, (params, answer.status, answer.body[:300])
        assert json.loads(answer.body)["choices"][0]["finish_reason"] == "length"


def test_prefill_engine_serves_a_plain_request_alone(socket_pd: Running, reference: dict[str, str],
                                                    requests_: dict[str, dict]) -> None:
    """The routing's ``whole`` path: a kv_producer prefill engine with the socket connector answers
    the client's own request (no kv_transfer_params) like one vLLM server, streamed or not."""
    for name in ("socket-whole-completion", "socket-whole-chat"):
        assert plain_answer(socket_pd.engines["prefill[0]"], requests_[name]) == reference[name]
    streamed = {**requests_["socket-whole-stream"], "stream": True}
    assert plain_answer(socket_pd.engines["prefill[0]"], streamed) == reference["socket-whole-stream"]


def test_engines_alive_and_idle_after_crafted_inputs(socket_pd: Running) -> None:
    assert engines_idle_and_alive(socket_pd.engines) == []


def test_down_leaves_nothing(socket_pd: Running, tiny_model: Path) -> None:
    procs = socket_pd.process_tree()
    assert len(procs) >= 3, "engines and proxy should still be running before `disagg down`"
    ports = [r.port for r in socket_pd.state().processes]
    done = socket_pd.down()
    assert done.returncode == 0, done.stderr
    _, alive = psutil.wait_procs(procs, timeout=10)
    assert not alive, f"left running after disagg down: {[p.pid for p in alive]}"
    assert busy_ports(ports) == [], ports
    assert not (socket_pd.run_dir / "runs" / socket_pd.topology.stem / "state.json").exists()
    assert not engine_processes(tiny_model)
