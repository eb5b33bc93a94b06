"""`disagg check` on every example topology, and its error output."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from disagg.cli import main

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((ROOT / "topologies").glob("*.yaml"))


def test_there_are_examples() -> None:
    names = {p.stem for p in EXAMPLES}
    assert {"local-cpu", "two-sparks-cx7", "house-2g5", "colocated", "replicas"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_check_each_example(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"topology {path.stem} ")
    engine_module = ("sglang.launch_server" if "engine    sglang" in out
                     else "vllm.entrypoints.openai.api_server")
    assert engine_module in out
    assert "ports: " in out and "proxy (builtin): " in out


def test_sglang_example_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(ROOT / "topologies/sglang-1p1d.yaml")]) == 0
    out = capsys.readouterr().out
    argv = _argv_of(out, "prefill[0]")
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    assert argv[argv.index("--disaggregation-bootstrap-port") + 1] == "8998"
    assert _env_of(out, "decode[0]")["MC_FORCE_TCP"] == "1"
    assert "--handoff-option bootstrap_ports=8998" in out


def test_lmcache_example_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(ROOT / "topologies/lmcache-1p1d.yaml")]) == 0
    out = capsys.readouterr().out
    cfg = json.loads(_argv_of(out, "decode[0]")[_argv_of(out, "decode[0]").index("--kv-transfer-config") + 1])
    assert cfg["kv_connector"] == "LMCacheConnectorV1" and cfg["kv_role"] == "kv_consumer"
    assert _env_of(out, "prefill[0]")["LMCACHE_CONFIG_FILE"].endswith("runs/lmcache-1p1d/prefill-0.lmcache.yaml")
    assert "      | pd_peer_init_port: [7300]" in out and "--handoff vllm-lmcache" in out


def test_nixl_push_example_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(ROOT / "topologies/local-cpu-nixl-push.yaml")]) == 0
    out = capsys.readouterr().out
    assert "mode      disaggregated, connector nixl-push" in out
    configs = {}
    for name in ("prefill[0]", "decode[0]"):
        argv = _argv_of(out, name)
        configs[name] = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        env = _env_of(out, name)
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1" and env["UCX_TLS"] == "tcp,self"
    assert configs["prefill[0]"] == {"kv_connector": "NixlPushConnector", "kv_role": "kv_producer",
                                     "kv_buffer_device": "cpu",
                                     "kv_connector_extra_config": {"backends": ["UCX"], "num_threads": 1}}
    assert configs["decode[0]"] == {**configs["prefill[0]"], "kv_role": "kv_consumer",
                                    "kv_load_failure_policy": "recompute"}
    assert "--handoff vllm-nixl-push" in out and "--handoff-option" not in out


def _argv_of(out: str, name: str) -> list[str]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(f"{name}:"))
    argv_line = next(line for line in lines[start:] if line.strip().startswith("argv:"))
    return shlex.split(argv_line.split("argv:", 1)[1])


def _env_of(out: str, name: str) -> dict[str, str]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(f"{name}:"))
    env_line = next(line for line in lines[start:] if line.strip().startswith("env:"))
    return dict(item.split("=", 1) for item in shlex.split(env_line.split("env:", 1)[1]))


def test_local_cpu_nixl_plan_is_exact(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(ROOT / "topologies/local-cpu-nixl.yaml")]) == 0
    out = capsys.readouterr().out
    argv = _argv_of(out, "prefill[0]")
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    cfg = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert cfg == {"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_buffer_device": "cpu",
                   "kv_connector_extra_config": {"backends": ["UCX"], "num_threads": 1}}
    dcfg = json.loads(_argv_of(out, "decode[0]")[_argv_of(out, "decode[0]").index("--kv-transfer-config") + 1])
    assert dcfg["kv_role"] == "kv_consumer"
    penv, denv = _env_of(out, "prefill[0]"), _env_of(out, "decode[0]")
    assert penv["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1" and penv["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5601"
    assert denv["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5602"
    assert (penv["VLLM_CPU_OMP_THREADS_BIND"], denv["VLLM_CPU_OMP_THREADS_BIND"]) == ("0", "1")
    assert penv["OMP_NUM_THREADS"] == "1" and penv["UCX_TLS"] == "tcp,self"
    assert "proxy     http://127.0.0.1:8000" in out


def test_two_hosts_use_their_link_addresses(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(ROOT / "topologies/house-2g5.yaml")]) == 0
    out = capsys.readouterr().out
    assert _env_of(out, "prefill[0]")["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "192.168.1.20"
    assert _env_of(out, "decode[0]")["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "192.168.1.30"
    assert _env_of(out, "decode[0]")["CUDA_VISIBLE_DEVICES"] == "0"
    decode_argv = _argv_of(out, "decode[0]")
    assert decode_argv[0] == "/opt/disagg/.venv/bin/python"
    assert json.loads(decode_argv[decode_argv.index("--kv-transfer-config") + 1])["kv_buffer_device"] == "cuda"


def test_broken_yaml_exits_2_with_location(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text((ROOT / "topologies/local-cpu.yaml").read_text().replace("port: 8200", "port: 8100"))
    assert main(["check", str(bad)]) == 2
    err = capsys.readouterr().err
    line = next(i for i, text in enumerate(bad.read_text().splitlines(), 1) if "kv_port: 5602" in text)
    assert err.strip() == f"disagg: error: {bad}:{line}: roles.decode[0].port: 8100 is already used by roles.prefill[0]"


def test_python_dash_m_works(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "disagg", "make-model", str(tmp_path / "m")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "KV 1024 bytes/token" in done.stdout
    assert (tmp_path / "m" / "model.safetensors").is_file()


def test_check_shows_the_socket_connectors_settings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    example = ROOT / "topologies/local-cpu.yaml"
    assert main(["check", str(example)]) == 0
    out = capsys.readouterr().out
    assert "  mode      disaggregated, connector socket (wire_format raw, streaming off)\n" in out
    assert "--handoff" not in out and "kv_peers" not in out   # vllm, the default handoff, goes unsaid
    text = example.read_text().replace("\nconnector: socket\n", "\nconnector: {type: socket, streaming: true}\n")
    streaming = tmp_path / "streaming.yaml"
    streaming.write_text(text)
    assert main(["check", str(streaming)]) == 0
    out = capsys.readouterr().out
    assert "  mode      disaggregated, connector socket (wire_format raw, streaming on: decode receives the KV " \
           "while prefill computes)\n" in out
    assert "--handoff vllm-socket-stream " in out and "--handoff-option kv_peers=127.0.0.1:5601 " in out
    assert main(["check", str(ROOT / "topologies/local-cpu-nixl.yaml")]) == 0
    assert "  mode      disaggregated, connector nixl\n" in capsys.readouterr().out
