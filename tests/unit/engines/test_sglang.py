"""The SGLang adapter's argv/env per role and link; with SGLang installed, the
argv also goes through SGLang's own ServerArgs parser."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest

from disagg.deployment import EngineLaunch, build_deployment
from disagg.errors import DeploymentError
from disagg.topology import parse_topology

BASE = """\
model: {path: /models/qwen, dtype: bfloat16, max_model_len: 4096}
engine: sglang
connector: CONNECTOR
link: LINK
hosts:
  p: {address: 10.0.0.1, device: cuda}
  d: {address: 10.0.0.2, device: cuda}
roles:
  prefill:
    - {host: p, port: 8100, kv_port: 8998, gpus: [0, 1], args: [--mem-fraction-static, "0.8"]}
  decode:
    - {host: d, port: 8200, gpus: [3], env: {EXTRA: "1"}}
"""


def plan(connector: str = "mooncake", link: str = "{type: ethernet, rate: 10gbit}",
         text: str = BASE) -> dict[str, EngineLaunch]:
    topo = parse_topology(textwrap.dedent(text).replace("CONNECTOR", connector).replace("LINK", link),
                          "t.yaml", run_dir="/tmp/run")
    return {e.name: e for e in build_deployment(topo).engines}


def flag(eng: EngineLaunch, name: str) -> str | None:
    argv = list(eng.argv)
    return argv[argv.index(name) + 1] if name in argv else None


def test_prefill_argv_has_every_flag() -> None:
    p = plan()["prefill[0]"]
    assert list(p.argv[1:3]) == ["-m", "sglang.launch_server"]
    assert [flag(p, f) for f in ("--model-path", "--host", "--port", "--dtype", "--context-length",
                                 "--tp-size", "--disaggregation-mode", "--disaggregation-transfer-backend",
                                 "--disaggregation-bootstrap-port")] == [
        "/models/qwen", "10.0.0.1", "8100", "bfloat16", "4096", "2", "prefill", "mooncake", "8998"]
    assert "--enable-metrics" in p.argv and list(p.argv[-2:]) == ["--mem-fraction-static", "0.8"]
    assert dict(p.env) == {"CUDA_VISIBLE_DEVICES": "0,1", "MC_FORCE_TCP": "1"}
    assert p.health_path == "/health"


def test_decode_has_no_bootstrap_port_and_keeps_its_env() -> None:
    d = plan()["decode[0]"]
    assert flag(d, "--disaggregation-mode") == "decode" and "--disaggregation-bootstrap-port" not in d.argv
    assert "--tp-size" not in d.argv
    assert dict(d.env) == {"CUDA_VISIBLE_DEVICES": "3", "MC_FORCE_TCP": "1", "EXTRA": "1"}


def test_roce_uses_the_ib_device_and_no_tcp_forcing() -> None:
    engines = plan(link="{type: roce, rate: 200gbit, interface: mlx5_0}")
    for eng in engines.values():
        assert flag(eng, "--disaggregation-ib-device") == "mlx5_0"
        assert "MC_FORCE_TCP" not in dict(eng.env)


def test_nixl_backend_pins_ucx_to_tcp_with_cuda_copies() -> None:
    engines = plan(connector="nixl")
    assert {flag(e, "--disaggregation-transfer-backend") for e in engines.values()} == {"nixl"}
    assert dict(engines["prefill[0]"].env)["UCX_TLS"] == "cuda_copy,tcp,self"
    assert "MC_FORCE_TCP" not in dict(engines["decode[0]"].env)


@pytest.mark.parametrize("connector", ["lmcache", "socket"])
def test_vllm_only_connectors_are_refused(connector: str) -> None:
    with pytest.raises(DeploymentError, match=f"connector '{connector}' does not work with engine sglang"):
        plan(connector=connector)


def test_colocated_is_a_plain_server_on_cpu() -> None:
    text = """\
    model: {path: /models/qwen}
    engine: sglang
    hosts: {h: {address: 127.0.0.1}}
    roles:
      both:
        - {host: h, port: 8300}
    """
    eng = plan(text=text)["both[0]"]
    assert not any(a.startswith("--disaggregation") for a in eng.argv)
    assert flag(eng, "--device") == "cpu" and dict(eng.env) == {}


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                    reason="package sglang is not in this interpreter; `make test` runs this test with sglang "
                           "via scripts/engine-package-checks.sh (docs/engines.md)")
def test_argv_parses_with_sglangs_own_parser() -> None:
    from disagg.enginecheck import check_sglang

    engines = plan(link="{type: roce, rate: 200gbit, interface: mlx5_0}")
    p, d = check_sglang(engines["prefill[0]"]), check_sglang(engines["decode[0]"])
    assert p["disaggregation_mode"] == "prefill" and p["disaggregation_bootstrap_port"] == 8998
    assert p["tp_size"] == 2 and p["disaggregation_ib_device"] == "mlx5_0"
    assert d["disaggregation_mode"] == "decode" and d["disaggregation_transfer_backend"] == "mooncake"
