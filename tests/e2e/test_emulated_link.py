"""1P1D across an emulated 1 Gb/s link between emulated hosts: the prefill engine in a network
namespace behind a tc-tbf-shaped veth, decode and proxy in the root namespace.
The KV cache really crosses the shaped veth, the answer equals the colocated
one, and `disagg down` removes the namespace.

The hosts emulate hardware too (one bring-up serves both checks): the prefill host prefills at
most :data:`PREFILL_RATE` tokens/s (connectors/emulated_prefill.py), which the engine's own
prefill-time histogram measures back; the decode host has a KV cache of :data:`KV_MEMORY` (the
engine's block count says so) and a CPU quota of :data:`CPU_SHARE` cores in a cgroup that holds
every process of that engine and that `disagg down` removes."""

from __future__ import annotations

import subprocess
from pathlib import Path

import psutil
import pytest

from disagg.emulation import cpu_share_for, emulated_link
from disagg.linkemu import netns_unavailable_reason
from disagg.prometheus_text import sample_sum as metric_value
from disagg.topology import load_topology
from harness.engines import ENGINE_ARGS, bring_up, free_ports, get_text, post_json

pytestmark = [pytest.mark.e2e, pytest.mark.netns,
              pytest.mark.skipif(netns_unavailable_reason() is not None, reason=str(netns_unavailable_reason()))]


def _rx_bytes(interface: str) -> int:
    return int(Path(f"/sys/class/net/{interface}/statistics/rx_bytes").read_text())


#: the prefill host's emulated rate (prompt tokens/s): far below what a core prefills the tiny model at
PREFILL_RATE = 1000
#: the decode host's KV cache (the tiny model has 1 KiB of KV per token)
KV_MEMORY = 96 * 2**20
CPU_SHARE = 0.9


def _cache_blocks(metrics: str) -> tuple[int, int]:
    """(num_gpu_blocks, block_size) from vLLM's ``vllm:cache_config_info`` labels."""
    line = next(ln for ln in metrics.splitlines() if ln.startswith("vllm:cache_config_info{"))
    labels = dict(part.split("=", 1) for part in line[line.index("{") + 1:line.index("}")].split(","))
    return int(labels["num_gpu_blocks"].strip('"')), int(labels["block_size"].strip('"'))


def test_pd_over_emulated_link(reference: dict[str, str], requests_: dict[str, dict], tiny_model: Path,
                               tmp_path: Path) -> None:
    proxy_port, p_port, d_port, p_kv, d_kv = free_ports(5)
    topo_path = tmp_path / "emu-1g.yaml"
    topo_path.write_text(f"""\
model: {{path: {tiny_model}, max_model_len: 4096, served_name: tiny}}
connector: nixl
link: {{type: emulated, rate: 1gbit}}
routing: {{policy: split}}
proxy: {{host: 127.0.0.1, port: {proxy_port}}}
hosts:
  p: {{address: 198.18.30.1, emulate: {{prefill_rate: {PREFILL_RATE}}}}}
  d: {{address: 198.18.30.2, emulate: {{kv_memory: {KV_MEMORY}, cpu_share: {CPU_SHARE}}}}}
roles:
  prefill: [{{host: p, port: {p_port}, kv_port: {p_kv}, cpus: [0], args: {ENGINE_ARGS}}}]
  decode: [{{host: d, port: {d_port}, kv_port: {d_kv}, cpus: [1], args: {ENGINE_ARGS}}}]
""")
    topo = load_topology(topo_path)
    link = emulated_link(topo)
    share = cpu_share_for(topo, topo.hosts["d"])
    assert share is not None
    cgroup = share.path()
    run = bring_up(topo_path, tmp_path / "run")
    try:
        assert link.a.namespace in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        decode, prefill = run.engines["decode[0]"], run.engines["prefill[0]"]
        before_rx, before = _rx_bytes(link.b.interface), get_text(decode + "/metrics")
        p_before = get_text(prefill + "/metrics")
        reply = post_json(run.proxy_url + "/v1/completions", requests_["long"])
        after_rx, after = _rx_bytes(link.b.interface), get_text(decode + "/metrics")
        p_after = get_text(prefill + "/metrics")
        assert reply["choices"][0]["text"] == reference["long"]
        moved = (metric_value(after, "vllm:nixl_bytes_transferred_sum")
                 - metric_value(before, "vllm:nixl_bytes_transferred_sum"))
        assert moved >= 1499 * 1024
        assert after_rx - before_rx >= moved  # the KV came in through the shaped veth

        # the prefill host's rate, measured back by the engine: its prefill time for the prompt
        tokens = reply["usage"]["prompt_tokens"]
        prefill_s = (metric_value(p_after, "vllm:request_prefill_time_seconds_sum")
                     - metric_value(p_before, "vllm:request_prefill_time_seconds_sum"))
        assert 0.8 * PREFILL_RATE <= tokens / prefill_s <= 1.02 * PREFILL_RATE, (tokens, prefill_s)
        # the decode host's KV cache is the emulated size (whole blocks of 1 KiB per token)
        blocks, block_size = _cache_blocks(after)
        assert KV_MEMORY - block_size * 1024 < blocks * block_size * 1024 <= KV_MEMORY, (blocks, block_size)
        # ... and every process of its engine runs under the quota
        assert (cgroup / "cpu.cfs_quota_us").read_text().strip() == str(round(CPU_SHARE * 100_000))
        members = {int(p) for p in (cgroup / "cgroup.procs").read_text().split()}
        leader = next(r.pid for r in run.state().processes if r.name == "decode[0]")
        engine = {leader, *(c.pid for c in psutil.Process(leader).children(recursive=True))}
        assert engine <= members and len(engine) >= 2, (engine, members)
    finally:
        done = run.down()
    assert done.returncode == 0, done.stderr
    assert not cgroup.exists()
    assert link.a.namespace not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not Path(f"/sys/class/net/{link.b.interface}").exists()
