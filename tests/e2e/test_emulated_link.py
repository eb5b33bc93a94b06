"""1P1D across an emulated 1 Gb/s link: the prefill engine in a network
namespace behind a tc-tbf-shaped veth, decode and proxy in the root namespace.
The KV cache really crosses the shaped veth, the answer equals the colocated
one, and `disagg down` removes the namespace."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from disagg.emulation import emulated_link
from disagg.linkemu import netns_unavailable_reason
from disagg.prometheus_text import sample_sum as metric_value
from disagg.topology import load_topology
from tests.e2e.engines import ENGINE_ARGS, bring_up, free_ports, get_text, post_json

pytestmark = [pytest.mark.e2e, pytest.mark.netns,
              pytest.mark.skipif(netns_unavailable_reason() is not None, reason=str(netns_unavailable_reason()))]


def _rx_bytes(interface: str) -> int:
    return int(Path(f"/sys/class/net/{interface}/statistics/rx_bytes").read_text())


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
  p: {{address: 198.18.30.1}}
  d: {{address: 198.18.30.2}}
roles:
  prefill: [{{host: p, port: {p_port}, kv_port: {p_kv}, cpus: [0], args: {ENGINE_ARGS}}}]
  decode: [{{host: d, port: {d_port}, kv_port: {d_kv}, cpus: [1], args: {ENGINE_ARGS}}}]
""")
    link = emulated_link(load_topology(topo_path))
    run = bring_up(topo_path, tmp_path / "run")
    try:
        assert link.a.namespace in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        decode = run.engines["decode[0]"]
        before_rx, before = _rx_bytes(link.b.interface), get_text(decode + "/metrics")
        reply = post_json(run.proxy_url + "/v1/completions", requests_["long"])
        after_rx, after = _rx_bytes(link.b.interface), get_text(decode + "/metrics")
        assert reply["choices"][0]["text"] == reference["long"]
        moved = (metric_value(after, "vllm:nixl_bytes_transferred_sum")
                 - metric_value(before, "vllm:nixl_bytes_transferred_sum"))
        assert moved >= 1499 * 1024
        assert after_rx - before_rx >= moved  # the KV came in through the shaped veth
    finally:
        done = run.down()
    assert done.returncode == 0, done.stderr
    assert link.a.namespace not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not Path(f"/sys/class/net/{link.b.interface}").exists()
