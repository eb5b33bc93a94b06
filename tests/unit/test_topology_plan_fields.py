"""The optional host fields `disagg plan` reads: gpu and kv_memory_gb."""

from __future__ import annotations

import re

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


def test_a_bare_number_names_a_gpu() -> None:
    assert topo("    gpu: 4090").hosts["p"].gpu == "rtx-4090"


def test_a_gpu_may_bring_its_own_spec_sheet() -> None:
    from disagg.planning import host_device

    host = topo("    gpu: {tflops: 209, memory_gb: 32, memory_bw_gbs: 1792, name: rtx-5090}").hosts["p"]
    assert host.gpu == "rtx-5090"
    spec = host_device(host)
    assert spec is not None and (spec.bf16_tflops, spec.memory_gb, spec.memory_gbps) == (209, 32, 1792)
    assert host_device(topo("    gpu: {tflops: 100, memory_gb: 16}").hosts["p"]).name == "custom"


@pytest.mark.parametrize(("extra", "message"), [
    ("    gpu: {tflops: 209}", "needs tflops (dense BF16, TFLOP/s) and memory_gb"),
    ("    gpu: {tflops: -1, memory_gb: 32}", "expected a number greater than 0"),
    ("    gpu: {tflops: 209, memory_gb: 32, watts: 450}", "watts"),
    ("    gpu: 4080", "unknown GPU 4080"),
])
def test_a_gpu_spec_sheet_is_validated(extra: str, message: str) -> None:
    with pytest.raises(TopologyError, match=re.escape(message)):
        topo(extra)


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
    ("topologies/house-2g5.yaml", "workstation", "gb10"),
    ("topologies/two-sparks-cx7.yaml", "spark-b", "gb10"),
])
def test_example_topologies_name_their_gpus(file: str, host: str, gpu: str) -> None:
    assert load_topology(file).hosts[host].gpu == gpu
