"""1P1D with NIXL through `disagg up`: greedy equality with a colocated server,
the engines' own counters proving the KV moved, a hung prefill and a killed decode engine
restarted, and Ctrl-C.

Tests in this module run in file order, after every other module on the shared NIXL 1P1D; the
last two change the deployment (hang the prefill engine until liveness restarts it while decode,
SIGKILLed mid-stream, is restarted too; then Ctrl-C the foreground `disagg up`).
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import socket
import time

import psutil
import pytest
from tokenizers import Tokenizer

from disagg.launch.state import ProcessRecord
from disagg.prometheus_text import sample_label as metric_label
from disagg.prometheus_text import sample_sum as metric_value
from disagg.prompts import exact_prompt
from disagg.topology import load_topology
from harness.engines import Running, get_text, open_stream, post_json, session_processes, settled_metrics
from tests.e2e.shared_deployment import NIXL, SharedDeployment

pytestmark = pytest.mark.e2e
SHARED_DEPLOYMENT = NIXL
TAKES_DOWN_SHARED = "test_ctrl_c_leaves_nothing"
KV_BYTES_PER_TOKEN = 1024  # the embedded tiny model, bf16


def test_up_reports_ready(pd: Running) -> None:
    assert f"ready: {pd.proxy_url}" in pd.up_output
    assert set(pd.engines) == {"prefill[0]", "decode[0]"}
    assert get_text(pd.proxy_url + "/health", timeout=10) is not None


def _vllm_workers(rec: ProcessRecord) -> list[psutil.Process]:
    """The ``VLLM::Worker`` processes (the compute) under an engine the run recorded."""
    return [p for p in psutil.Process(rec.pid).children(recursive=True) if p.name() == "VLLM::Worker"]


def test_each_engine_computes_on_its_own_core(pd: Running) -> None:
    """The workers' compute threads stay on the topology's `cpus` ([0] and [1]).

    Stock vLLM's NIXL worker moves its compute thread to the machine's last core
    (here: the decode engine's) whatever VLLM_CPU_OMP_THREADS_BIND says; the
    launcher's DISAGG_NIXL_CPU_AFFINITY=own-cores plugin keeps it home.
    """
    expected = {"prefill[0]": {0}, "decode[0]": {1}}
    seen: dict[str, list[set[int]]] = {}
    for rec in pd.state().processes:
        if rec.name in expected:
            seen[rec.name] = [os.sched_getaffinity(w.pid) for w in _vllm_workers(rec)]  # the main (compute) thread
    assert seen == {name: [cores] for name, cores in expected.items()}


def test_no_engine_thread_spins_while_idle(pd: Running) -> None:
    """Idle, no thread of either engine's worker takes a quarter of a core: NIXL's progress thread
    waits for UCX events (the launcher's DISAGG_NIXL_PROGRESS_WAIT_US plugin, which each engine's
    log names); as NIXL's Python API builds it, it would spin on the engine's only core."""
    engines = [rec for rec in pd.state().processes if rec.name in ("prefill[0]", "decode[0]")]
    workers = [w for rec in engines for w in _vllm_workers(rec)]
    assert len(workers) == 2

    def cpu_seconds() -> dict[tuple[int, int], float]:
        return {(w.pid, t.id): t.user_time + t.system_time for w in workers for t in w.threads()}

    time.sleep(1.5)                  # vLLM's queue readers spin for a second after a step
    before = cpu_seconds()
    time.sleep(2.0)
    used = {key: seconds - before.get(key, 0.0) for key, seconds in cpu_seconds().items()}
    assert max(used.values()) < 0.5, sorted(used.items(), key=lambda kv: -kv[1])[:3]
    for rec in engines:
        with open(rec.log, errors="replace") as log:
            assert "NIXL's progress thread waits for UCX events" in log.read(), rec.log


@pytest.mark.parametrize("name", ["short", "long"])
def test_handoff_equals_colocated_and_kv_moved(pd: Running, reference: dict[str, str],
                                               requests_: dict[str, dict], name: str) -> None:
    decode = pd.engines["decode[0]"]
    before, proxy_before = get_text(decode + "/metrics"), get_text(pd.proxy_url + "/metrics")
    reply = post_json(pd.proxy_url + "/v1/completions", requests_[name])
    after, proxy_after = get_text(decode + "/metrics"), get_text(pd.proxy_url + "/metrics")

    assert reply["choices"][0]["text"] == reference[name]
    tokens = reply["usage"]["prompt_tokens"]
    assert tokens == {"short": 50, "long": 1500}[name]

    def delta(metric: str, **labels: str) -> float:
        return metric_value(after, metric, **labels) - metric_value(before, metric, **labels)

    block = int(metric_label(after, "vllm:cache_config_info", "block_size") or 0)
    assert block > 0
    moved = delta("vllm:nixl_bytes_transferred_sum")
    # Whole blocks of the prompt move: at least every token but the last, at most one block more.
    assert (tokens - 1) * KV_BYTES_PER_TOKEN <= moved <= (tokens + block) * KV_BYTES_PER_TOKEN, moved
    assert delta("vllm:nixl_num_failed_transfers_total") == 0
    # The decode engine took the prompt from the transfer, not by recomputing it.
    assert delta("vllm:prompt_tokens_by_source_total", source="external_kv_transfer") >= tokens - 1
    assert delta("vllm:prompt_tokens_by_source_total", source="local_compute") <= 1
    # The proxy counted it as a disaggregated request and timed its prefill.
    for metric, labels in (("disagg_proxy_requests_total", {"path": "split"}),
                           ("disagg_proxy_prefill_seconds_count", {})):
        grew = metric_value(proxy_after, metric, **labels) - metric_value(proxy_before, metric, **labels)
        assert grew == 1, (metric, grew)


def test_client_disconnect_aborts_decode(pd: Running, tokenizer: Tokenizer) -> None:
    """A client that hangs up mid-stream frees the engines: the decode engine aborts the request.

    The request asks for 8000 tokens (the model's whole context; seconds to half a minute on these
    CPUs); if the hang-up did not reach the engine, it would run them all and count the request
    as finished by length. Instead nothing runs any more within seconds
    and no request finished by length (what running to its end counts).
    """
    decode = pd.engines["decode[0]"]
    before = settled_metrics(decode)   # every earlier request counted
    conn, _ = open_stream(pd.proxy_url, exact_prompt(tokenizer, 40, "disconnect"))
    started = time.monotonic()   # at once: the request can end while a busy engine answers /metrics
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    deadline = started + 30
    while time.monotonic() < deadline:
        after = get_text(decode + "/metrics")
        if metric_value(after, "vllm:num_requests_running") + metric_value(after, "vllm:num_requests_waiting") == 0:
            break
        time.sleep(0.1)
    stopped = time.monotonic() - started

    def finished(text: str) -> float:   # by length: how an 8,000-token ignore_eos request ends but for an abort
        return metric_value(text, "vllm:request_success_total", finished_reason="length")

    generated = (metric_value(after, "vllm:generation_tokens_total")
                 - metric_value(before, "vllm:generation_tokens_total"))
    print(f"decode stopped {stopped:.2f} s after the hang-up, {generated:.0f} tokens later")
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert metric_value(after, gauge) == 0, f"{gauge} not 0 {stopped:.1f} s after the hang-up"
    assert finished(after) == finished(before), f"the request ran to its end: {generated:.0f} tokens"
    assert 1 <= generated < 8000, generated
    assert metric_value(get_text(pd.engines["prefill[0]"] + "/metrics"), "vllm:num_requests_running") == 0


def _restarted(pd: Running, name: str, old_pid: int, deadline: float) -> ProcessRecord:
    """``name``'s record once `disagg up` has started it again and it is healthy."""
    while True:
        again = next(r for r in pd.state().processes if r.name == name)
        if again.status == "running" and again.pid != old_pid:
            return again
        assert time.monotonic() < deadline, f"{name} was not restarted"
        time.sleep(0.5)


def _gone_after(pid: int, since: float) -> concurrent.futures.Future[float]:
    """Seconds from ``since`` (monotonic) until process ``pid`` has finished exiting (gone, or a
    zombie with no thread left: its files, and so its connections, closed), found by a thread
    polling every 20 ms (for up to 60 s)."""
    def wait() -> float:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE and len(os.listdir(f"/proc/{pid}/task")) <= 1:
                    break
            except (psutil.NoSuchProcess, FileNotFoundError):
                break
            time.sleep(0.02)
        return time.monotonic() - since
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gone")
    try:
        return pool.submit(wait)
    finally:
        pool.shutdown(wait=False)   # its thread ends with the wait


def _in_rotation(pd: Running, role: str) -> float:
    """The proxy's ``backend_healthy`` gauge of the ``role`` engine (1: in rotation, 0: out)."""
    return metric_value(get_text(pd.proxy_url + "/metrics"), "disagg_proxy_backend_healthy", role=role)


def test_a_hung_prefill_and_a_decode_killed_mid_stream_are_restarted_while_decode_serves_alone(
        pd: Running, reference: dict[str, str], requests_: dict[str, dict], tokenizer: Tokenizer) -> None:
    """Prefill's API server SIGSTOPped (alive, answering nothing): the proxy takes it out of
    rotation at its second missed probe and decode serves alone meanwhile. Then decode's API server
    is SIGKILLed mid-stream: the streaming client gets an error event within 5 s. `disagg up`
    (foreground) restarts decode at once, nothing of the old one left, and prefill once it has
    failed every probe for timeouts.liveness (its group killed); the proxy takes both back (and
    counts the returns), and prompts split again, their KV moving between the new engines. The
    two restarts overlap, each engine on its own core: one restart's wait for both."""
    records = {r.name: r for r in pd.state().processes}
    prefill, decode = records["prefill[0]"], records["decode[0]"]
    assert (prefill.restarts, decode.restarts) == (0, 0), "the shared deployment's engines were restarted before"
    old_decode = session_processes(decode.pid)
    assert len(old_decode) >= 2, "decode's API server and its EngineCore"
    stopped = time.monotonic()
    os.kill(prefill.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 60
    while _in_rotation(pd, "prefill") != 0:
        assert time.monotonic() < deadline, "the proxy kept a hung prefill[0] in rotation"
        time.sleep(0.2)
    out_of_rotation = time.monotonic() - stopped
    reply = post_json(pd.proxy_url + "/v1/completions", requests_["prefill-killed"])
    assert reply["choices"][0]["text"] == reference["prefill-killed"]
    proxy_metrics = get_text(pd.proxy_url + "/metrics")
    assert metric_value(proxy_metrics, "disagg_proxy_requests_total", path="fallback") == 1
    assert metric_value(proxy_metrics, "disagg_proxy_fallbacks_total") == 1

    conn, resp = open_stream(pd.proxy_url, exact_prompt(tokenizer, 40, "decode-killed"), timeout=60)
    os.kill(decode.pid, signal.SIGKILL)
    killed = time.monotonic()
    gone = _gone_after(decode.pid, killed)
    rest = ""  # the raw chunked body (chunk sizes included) until the proxy ends the stream
    while (line := resp.fp.readline()) and "data: [DONE]" not in rest:
        rest += line.decode()
    ended = time.monotonic() - killed
    conn.close()
    # The proxy learns of the death when the engine's connection closes, as the killed process
    # finishes exiting: a few ms, or seconds on a stalled machine (10.8 s seen under CI, with the
    # supervisor seeing it exit as late), so the stream's end counts from there.
    exited = gone.result(timeout=60)
    assert ended - exited < 5.0 and ended < 30.0, \
        f"the stream ended {ended:.2f} s after decode's API server was SIGKILLed ({exited:.2f} s after it exited)"
    assert '"error"' in rest and "data: [DONE]" in rest, rest[-500:]

    deadline = time.monotonic() + 300
    decode_again = _restarted(pd, "decode[0]", decode.pid, deadline)
    assert not [p for p in old_decode if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert (decode_again.restarts, decode_again.last_exit) == (1, "killed by SIGKILL")
    prefill_again = _restarted(pd, "prefill[0]", prefill.pid, deadline)
    assert prefill_again.restarts == 1 and "timeouts.liveness" in prefill_again.last_exit, prefill_again.last_exit
    assert not psutil.pid_exists(prefill.pid) or psutil.Process(prefill.pid).status() == psutil.STATUS_ZOMBIE
    for role in ("prefill", "decode"):
        while _in_rotation(pd, role) != 1:
            assert time.monotonic() < deadline, f"the proxy did not take the {role} engine back"
            time.sleep(0.2)
    before = get_text(pd.proxy_url + "/metrics")
    reply = post_json(pd.proxy_url + "/v1/completions", requests_["prefill-killed"])
    assert reply["choices"][0]["text"] == reference["prefill-killed"]
    after = get_text(pd.proxy_url + "/metrics")
    assert (metric_value(after, "disagg_proxy_requests_total", path="split")
            - metric_value(before, "disagg_proxy_requests_total", path="split")) == 1
    # the new decode engine (no earlier request) pulled the prompt's KV from the new prefill engine
    tokens = reply["usage"]["prompt_tokens"]
    moved = metric_value(get_text(pd.engines["decode[0]"] + "/metrics"), "vllm:nixl_bytes_transferred_sum")
    assert moved >= (tokens - 1) * KV_BYTES_PER_TOKEN, (moved, tokens)
    assert metric_value(after, "disagg_proxy_backend_returns_total", role="prefill") == 1
    assert (metric_value(after, "disagg_proxy_backend_returns_total", role="decode")
            - metric_value(proxy_metrics, "disagg_proxy_backend_returns_total", role="decode")) == 1
    print(f"\nhung prefill: out of rotation after {out_of_rotation:.1f} s; decode's stream ended {ended:.2f} s "
          f"after its SIGKILL; both serving again after {time.monotonic() - stopped:.1f} s "
          f"(timeouts.liveness: {load_topology(pd.topology).timeouts.liveness:g} s)")


def test_ctrl_c_leaves_nothing(pd: Running, shared_deployment: SharedDeployment) -> None:
    """Ctrl-C to the foreground `disagg up` exits 0 and leaves nothing: processes, ports, state
    file, engines on the model (shared_deployment.ctrl_c_problems)."""
    assert shared_deployment.run is pd
    assert shared_deployment.release() == []
