"""Remote engines over a real sshd: `down` sweeps what a SIGKILLed leader left on the
remote host, and an SSH outage keeps the state instead of forgetting the engine.
Also: a stale state's network namespace is removed with it.

A real sshd in a network namespace stands for the remote host
(``tests/e2e/sshhost.py``; it shares this machine's process table, so the test
can see and SIGKILL the remote processes). The remote "engine" is the stand-in
process tree of tests/unit/launch/standins.py, started by ``start_remote`` the
way the launcher starts a remote engine. Skips only without namespaces or OpenSSH.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from disagg.cli import main
from disagg.deployment import build_deployment
from disagg.emulation import link_tag
from disagg.launch import processes
from disagg.launch.launcher import Launcher
from disagg.launch.processes import Liveness
from disagg.launch.state import ProcessRecord, RunState, save_state
from disagg.linkemu import netns_unavailable_reason
from disagg.topology import HostSpec, load_topology
from tests.e2e.sshhost import HOST_ADDR, ssh_namespace, unavailable_reason
from tests.unit.launch.standins import ENGINE_TREE, TREE_SIZE, kill_all, running

pytestmark = pytest.mark.netns


def _remote_tree(tmp_path: Path, remote) -> tuple[ProcessRecord, list[psutil.Process]]:
    host = HostSpec(name="far", address=remote.address, ssh=f"{remote.user}@{remote.address}",
                    ssh_port=remote.port, ssh_key=str(remote.key),
                    ssh_options=(f"UserKnownHostsFile={tmp_path / 'known_hosts'}",))
    log = str(tmp_path / "remote" / "engine.log")
    pid = processes.start_remote(host, f"{shlex.quote(sys.executable)} -c {shlex.quote(ENGINE_TREE)}", log)
    rec = ProcessRecord(name="prefill[0]", kind="engine", host="far", address=remote.address, port=8100,
                        url=f"http://{remote.address}:8100", log=log, pid=pid, ssh=processes.ssh_prefix(host))
    deadline = time.monotonic() + 60
    while True:
        try:
            tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        except psutil.Error:
            tree = []
        if len(tree) == TREE_SIZE:
            return rec, tree
        assert time.monotonic() < deadline, "the remote stand-in tree did not come up"
        time.sleep(0.1)


def _state(tmp_path: Path, *recs: ProcessRecord) -> Path:
    return save_state(RunState(topology="/t.yaml", name="t", run_dir=str(tmp_path / "run"),
                               proxy_url="http://127.0.0.1:1", started_at=time.time(), up_pid=1,
                               processes=list(recs)))


def _host_side_interface() -> str:
    """The veth on this side of the sshd namespace (found by its address)."""
    out = subprocess.run(["ip", "-o", "-4", "addr", "show", "to", f"{HOST_ADDR}/32"], capture_output=True,
                         text=True, check=True).stdout
    return out.split()[1]


@pytest.fixture
def remote_host(tmp_path: Path):
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"no namespaced sshd here: {reason}")
    with ssh_namespace(tmp_path / "ssh") as remote:
        yield remote


def test_down_sweeps_a_remote_group_whose_leader_was_sigkilled(tmp_path: Path, remote_host,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    rec, tree = _remote_tree(tmp_path, remote_host)
    try:
        assert processes.liveness(rec) is Liveness.RUNNING
        os.kill(rec.pid, signal.SIGKILL)   # the remote API server, as the OOM killer would
        time.sleep(0.5)
        assert len(running(tree)) == TREE_SIZE - 1
        assert processes.liveness(rec) is Liveness.LEFTOVERS
        _state(tmp_path, rec)
        assert main(["down", "--run-dir", str(tmp_path / "run"), "--grace", "1"]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out == [f"prefill[0]: its leader (pid {rec.pid}) had exited; stopped the {TREE_SIZE - 1} processes "
                       "of its group it left behind", "t: down"]
        assert running(tree) == []
    finally:
        kill_all(tree)


def test_down_during_an_ssh_outage_keeps_the_state_and_retries(tmp_path: Path, remote_host,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    rec, tree = _remote_tree(tmp_path, remote_host)
    # ssh keeps the first value of an option: a 2 s connect timeout ahead of the launcher's 10 s keeps this short
    rec = ProcessRecord(**{**rec.__dict__, "ssh": ["ssh", "-o", "ConnectTimeout=2", *rec.ssh[1:]]})
    interface = _host_side_interface()
    try:
        state = _state(tmp_path, rec)
        subprocess.run(["ip", "link", "set", interface, "down"], check=True)
        try:
            assert processes.liveness(rec) is Liveness.UNREACHABLE
            assert main(["status", "--run-dir", str(tmp_path / "run")]) == 1
            assert "unknown (host unreachable over ssh)" in capsys.readouterr().out
            started = time.monotonic()
            assert main(["down", "--run-dir", str(tmp_path / "run"), "--grace", "1"]) == 2
            assert time.monotonic() - started < 30
            err = capsys.readouterr().err
            assert "could not stop everything; the state file is kept" in err
            assert f"prefill[0] on far ({remote_host.user}@{remote_host.address}): could not reach the host" in err
            assert state.exists() and len(running(tree)) == TREE_SIZE  # not forgotten, not touched
        finally:
            subprocess.run(["ip", "link", "set", interface, "up"], check=True)
        deadline = time.monotonic() + 20
        while processes.liveness(rec) is Liveness.UNREACHABLE and time.monotonic() < deadline:
            time.sleep(0.5)
        assert main(["down", "--run-dir", str(tmp_path / "run"), "--grace", "1"]) == 0
        assert capsys.readouterr().out.splitlines() == [f"prefill[0]: stopped (pid {rec.pid})", "t: down"]
        assert running(tree) == [] and not state.exists()
    finally:
        kill_all(tree)


def test_stale_state_goes_with_its_network_namespace(tmp_path: Path) -> None:
    reason = netns_unavailable_reason()
    if reason is not None:
        pytest.skip(f"cannot create network namespaces here: {reason}")
    topo = tmp_path / "stale.yaml"
    topo.write_text(f"name: stale-{os.getpid()}\nmodel: {{path: /models/m}}\n"
                    "link: {type: emulated, rate: 1gbit}\n"
                    "hosts: {p: {address: 198.18.200.1}, d: {address: 198.18.200.2}}\n"
                    "roles: {prefill: [{host: p, port: 8100}], decode: [{host: d, port: 8200}]}\n")
    dep = build_deployment(load_topology(topo, run_dir=str(tmp_path / "run")))
    namespace = f"disagg-{link_tag(dep.topology)}-a"
    subprocess.run(["ip", "netns", "add", namespace], check=True)
    try:
        dead = ProcessRecord(name="prefill[0]", kind="engine", host="p", address="198.18.200.1", port=8100,
                             url="http://x", log="l", pid=999_999_99, create_time=1.0)
        save_state(RunState(topology=str(topo), name=dep.topology.name, run_dir=str(tmp_path / "run"),
                            proxy_url="http://x", started_at=1.0, up_pid=1, processes=[dead], namespaces=[namespace]))
        lines: list[str] = []
        Launcher(dep, echo=lines.append)._refuse_if_running()
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
        assert namespace not in listed
        assert lines[0] == f"link: removed network namespace {namespace} of an earlier run"
    finally:
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
