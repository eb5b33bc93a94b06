"""The optional host fields `disagg plan` reads: gpu and kv_memory_gb."""

from __future__ import annotations

import pytest

from disagg.errors import TopologyError
from disagg.topology import load_topology, parse_topology

TEMPLATE = """\
model: meta-llama/Llama-3.1-8B-Instruct
link: {{type: ethernet, rate: 10gbit}}
hosts:
  p:
    address: 10.0.0.1
    device: cuda
{extra}
  d: {{address: 10.0.0.2, device: cuda}}
roles:
  prefill: [{{host: p, port: 8100}}]
  decode: [{{host: d, port: 8200}}]
"""


def topo(extra: str):
    return parse_topology(TEMPLATE.format(extra=extra), "t.yaml")


def test_gpu_and_kv_memory_are_parsed_and_canonical() -> None:
    t = topo("    gpu: DGX-Spark\n    kv_memory_gb: 20.5")
    assert t.hosts["p"].gpu == "gb10"
    assert t.hosts["p"].kv_memory_gb == 20.5
    assert t.hosts["d"].gpu is None and t.hosts["d"].kv_memory_gb is None


def test_unknown_gpu_names_file_line_field_and_suggests() -> None:
    with pytest.raises(TopologyError) as info:
        topo("    gpu: rtx-4080")
    msg = str(info.value)
    assert msg.startswith("t.yaml:7: hosts.p.gpu: unknown GPU 'rtx-4080'")
    assert "did you mean 'rtx-4090'" in msg


def test_gpu_on_a_cpu_host_is_an_error() -> None:
    text = TEMPLATE.format(extra="    gpu: h100").replace("    device: cuda\n", "", 1)
    with pytest.raises(TopologyError, match=r"t.yaml:6: hosts.p.gpu: .*device: cuda"):
        parse_topology(text, "t.yaml")


def test_kv_memory_must_be_positive() -> None:
    with pytest.raises(TopologyError, match=r"t.yaml:7: hosts.p.kv_memory_gb: expected a number greater than 0"):
        topo("    kv_memory_gb: -3")
    with pytest.raises(TopologyError, match=r"hosts.p.kv_memory_gb: expected a number"):
        topo("    kv_memory_gb: lots")


@pytest.mark.parametrize(("file", "host", "gpu"), [
    ("topologies/house-2g5.yaml", "gamer", "rtx-4090"),
    ("topologies/house-2g5.yaml", "workstation", "rtx-6000-ada"),
    ("topologies/two-sparks-cx7.yaml", "spark-b", "gb10"),
])
def test_example_topologies_name_their_gpus(file: str, host: str, gpu: str) -> None:
    assert load_topology(file).hosts[host].gpu == gpu
