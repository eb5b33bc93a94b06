"""1P1D with vLLM's NIXL connector in push mode (``connector: nixl-push``) through `disagg up`,
across an emulated link (the prefill host in a network namespace behind a tc-shaped veth, as two
machines would be: NIXL's side channel and UCX between two addresses): greedy equality with a
colocated server, the engines' own counters proving the KV moved, the veth's bytes that it
crossed the link, and `disagg down` removing namespace and veth. The other NIXL deployment (the
shared one, pulling the KV) runs over loopback.

The deployment is this module's own (`disagg up --detach`, stopped when the module ends); the
shared deployments are down while it runs (tests/e2e/shared_deployment.py), and it refuses to start
while any other engine on the session's model still runs (never more than two engines at once).

The proxy's push handoff (disagg/proxy/nixl_push_handoff.py) serves the first split in turn
(prefill first: it learns the prefill engine's NIXL engine id from the reply), every later one
with both requests at once (decode registers its blocks while prefill computes, prefill WRITEs
into them when it finishes).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from disagg.emulation import emulated_link
from disagg.linkemu import netns_unavailable_reason
from disagg.prometheus_text import sample_label as metric_label
from disagg.prometheus_text import sample_sum as metric_value
from disagg.topology import load_topology
from harness.engines import (
    ENGINE_ARGS,
    SPLIT_EVERY_PROMPT,
    Running,
    bring_up,
    engine_processes,
    free_ports,
    get_text,
    plain_answer,
)
from tests.e2e.emulated_links import left_of, namespace_listed, received_bytes

pytestmark = [pytest.mark.e2e, pytest.mark.netns,
              pytest.mark.skipif(netns_unavailable_reason() is not None, reason=str(netns_unavailable_reason()))]
KV_BYTES_PER_TOKEN = 1024  # the embedded tiny model, bf16 (as in test_pd.py)

#: the requests of conftest's ``requests_`` served here, in order: the first goes in turn, the
#: rest at once (completion and chat, streamed and not, 50 to 1,500 prompt tokens)
NAMES = ("short", "sync-completion-stream", "sync-chat-stream", "async-chat", "long")


@pytest.fixture(scope="module")
def push_pd(reference: dict[str, str], e2e_dir: Path, tiny_model: Path) -> Iterator[Running]:
    """1 prefill + 1 decode with NixlPushConnector behind the proxy, one pinned core each, the
    prefill host across an emulated 1 Gb/s link; the namespace and veth gone after `disagg down`."""
    assert not engine_processes(tiny_model), "engines of another deployment still run"
    proxy_port, p_port, d_port, p_kv, d_kv = free_ports(5)
    topo = e2e_dir / "pd-nixl-push.yaml"
    topo.write_text(f"""\
model: {{path: {tiny_model}, max_model_len: 8192, served_name: tiny}}
engine: vllm
connector: nixl-push
link: {{type: emulated, rate: 1gbit}}
proxy: {{host: 127.0.0.1, port: {proxy_port}}}
hosts:
  p: {{address: 198.18.32.1, device: cpu}}
  d: {{address: 198.18.32.2, device: cpu}}
roles:
  prefill: [{{host: p, port: {p_port}, kv_port: {p_kv}, cpus: [0], args: {ENGINE_ARGS}}}]
  decode: [{{host: d, port: {d_port}, kv_port: {d_kv}, cpus: [1], args: {ENGINE_ARGS}}}]
{SPLIT_EVERY_PROMPT}""")
    link = emulated_link(load_topology(topo))
    run = bring_up(topo, e2e_dir / "run-pd-nixl-push")
    assert namespace_listed(link)
    yield run                                            # pytest runs what follows however the tests went
    stopped = run.down()
    assert stopped.returncode == 0 and not engine_processes(tiny_model), stopped.stderr
    assert left_of(link) == []


def test_push_handoff_equals_colocated_and_kv_moved(push_pd: Running, reference: dict[str, str],
                                                    requests_: dict[str, dict]) -> None:
    cmdlines = [" ".join(p.cmdline()) for p in push_pd.process_tree()]
    assert sum("NixlPushConnector" in c for c in cmdlines if "api_server" in c) == 2, cmdlines
    assert any("--handoff vllm-nixl-push" in c for c in cmdlines), cmdlines
    prefill, decode = push_pd.engines["prefill[0]"], push_pd.engines["decode[0]"]
    link = emulated_link(load_topology(push_pd.topology))   # the fixture's, derived from the same file
    rx_before, moved_in_all = received_bytes(link), 0.0
    for name in NAMES:
        body = requests_[name]
        before = {url: get_text(url + "/metrics") for url in (prefill, decode, push_pd.proxy_url)}
        text = plain_answer(push_pd.proxy_url, body)
        after = {url: get_text(url + "/metrics") for url in (prefill, decode, push_pd.proxy_url)}
        # P's NIXL counters reach /metrics with its engine core's stats, which may trail the reply
        # (CI once read a WRITE's bytes as 0 right after D's answer): wait for them, up to 10 s
        deadline = time.monotonic() + 10
        while (metric_value(after[prefill], "vllm:nixl_xfer_time_seconds_count")
               == metric_value(before[prefill], "vllm:nixl_xfer_time_seconds_count")
               and time.monotonic() < deadline):
            time.sleep(0.2)
            after[prefill] = get_text(prefill + "/metrics")

        def delta(url: str, metric: str, before: dict[str, str] = before, after: dict[str, str] = after,
                  **labels: str) -> float:
            return metric_value(after[url], metric, **labels) - metric_value(before[url], metric, **labels)

        assert text == reference[name], name
        tokens = delta(prefill, "vllm:prompt_tokens_total")
        assert tokens >= 50, (name, tokens)
        # P WROTE the prompt's blocks (push mode counts its transfers on the writing side): at least
        # every token but the last, at most one block more
        block = int(metric_label(after[decode], "vllm:cache_config_info", "block_size") or 0)
        assert block > 0
        moved = delta(prefill, "vllm:nixl_bytes_transferred_sum")
        assert (tokens - 1) * KV_BYTES_PER_TOKEN <= moved <= (tokens + block) * KV_BYTES_PER_TOKEN, (name, moved)
        moved_in_all += moved
        assert delta(prefill, "vllm:nixl_xfer_time_seconds_count") >= 1, name
        # D took the prompt from that WRITE, not by computing it (but for the last token, which it computes)
        assert delta(decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") >= tokens - 1, name
        assert delta(decode, "vllm:prompt_tokens_by_source_total", source="local_compute") <= 1, name
        for url in (prefill, decode):
            assert delta(url, "vllm:nixl_num_failed_transfers_total") == 0, name
            assert delta(url, "vllm:nixl_num_failed_notifications_total") == 0, name
        # the proxy served it through the handoff, not decode alone
        assert delta(push_pd.proxy_url, "disagg_proxy_requests_total", path="split") == 1, name
        assert delta(push_pd.proxy_url, "disagg_proxy_fallbacks_total") == 0, name
    # the KV crossed the link: the decode host's end of the veth received at least what P wrote
    assert received_bytes(link) - rx_before >= moved_in_all, (received_bytes(link) - rx_before, moved_in_all)
    # the proxy learned the prefill engine once, serving the first route in turn; the others went at once
    log = (push_pd.run_dir / "runs" / push_pd.topology.stem / "logs" / "proxy.log").read_text()
    assert log.count(": NIXL engine ") == 1, log[-2000:]
    assert log.count("prefill, then decode, in turn") == 1, log[-2000:]
