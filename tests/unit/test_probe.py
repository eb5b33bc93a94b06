"""The probe-link agent and its orchestration, over loopback (no namespaces needed)."""

from __future__ import annotations

import subprocess
from dataclasses import replace

import pytest

from disagg.errors import LinkError
from disagg.probe import AgentSide, measure, probe_topology, ssh_argv
from disagg.ssh import ssh_prefix
from disagg.topology import HostSpec, parse_topology

LOCAL = HostSpec(name="here", address="127.0.0.1")
REMOTE = HostSpec(name="far", address="10.1.2.3", ssh="me@far", ssh_port=2222, ssh_key="/k/id", python="/v/bin/python")


DEFAULTS = ["-o", "ConnectTimeout=10", "-o", "StrictHostKeyChecking=accept-new", "-o", "LogLevel=ERROR"]


def test_ssh_command_line_is_the_launchers() -> None:
    assert ssh_argv(REMOTE, ["python", "-m", "x", "a b"]) == [
        "ssh", "-o", "BatchMode=yes", *DEFAULTS, "-p", "2222", "-i", "/k/id", "me@far", "python -m x 'a b'"]
    assert ssh_argv(REMOTE, ["true"])[:-1] == ssh_prefix(REMOTE)  # `disagg up` reaches it the same way


def test_the_hosts_ssh_options_come_first_so_they_win_except_batch_mode() -> None:
    host = replace(REMOTE, ssh_options=("ConnectTimeout=30", "UserKnownHostsFile=/k/known"))
    argv = ssh_argv(host, ["true"], ["-v"])
    assert argv[:7] == ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=30", "-o", "UserKnownHostsFile=/k/known"]
    assert argv.index("ConnectTimeout=30") < argv.index("ConnectTimeout=10")  # ssh keeps the first value
    assert argv[-3:] == ["-v", "me@far", "true"]


def test_remote_side_runs_the_hosts_python_over_ssh() -> None:
    argv = AgentSide(REMOTE, REMOTE.address).argv("serve", "--bind", "10.1.2.3")
    assert argv[:-1] == ["ssh", "-o", "BatchMode=yes", *DEFAULTS, "-p", "2222", "-i", "/k/id", "me@far"]
    assert argv[-1] == "/v/bin/python -m disagg._probe_agent serve --bind 10.1.2.3"


def test_local_side_can_be_wrapped() -> None:
    side = AgentSide(LOCAL, "198.18.0.1", lambda argv: ["ip", "netns", "exec", "ns", *argv])
    assert side.argv("send")[:4] == ["ip", "netns", "exec", "ns"]
    assert side.argv("send")[-3:] == ["-m", "disagg._probe_agent", "send"]


def test_measure_over_loopback() -> None:
    rates, rtt = measure(AgentSide(LOCAL, "127.0.0.1"), AgentSide(LOCAL, "127.0.0.1"),
                         streams=(1, 2), seconds=0.3, pings=5)
    assert set(rates) == {1, 2}
    assert all(r > 1e7 for r in rates.values())   # loopback moves far more than 10 Mb/s
    assert 0 < rtt < 0.5


def test_probe_topology_local_hosts() -> None:
    topo = parse_topology("""\
model: disagg:tiny
hosts: {local: {address: 127.0.0.1}}
roles: {prefill: [{port: 8100}], decode: [{port: 8200}]}
""", "t.yaml")
    m = probe_topology(topo, streams=(1,), seconds=0.2)
    assert m.path == "local" and m.method == "python"
    assert m.prefill_host == m.decode_host == "local" and m.best_bps > 0


def test_receiver_that_cannot_bind_is_a_clear_error() -> None:
    side = AgentSide(LOCAL, "192.0.2.77")   # TEST-NET-1: not an address of this machine
    with pytest.raises(LinkError, match=r"probe receiver on here \(192.0.2.77\) did not start:.*ssign"):
        measure(AgentSide(LOCAL, "127.0.0.1"), side, streams=(1,), seconds=0.1)


def test_sender_failure_names_the_target() -> None:
    failing = AgentSide(LOCAL, "127.0.0.1", lambda argv: ["false"] if "send" in argv else argv)
    with pytest.raises(LinkError, match=r"probe sender on here -> 127.0.0.1:\d+ failed"):
        measure(failing, AgentSide(LOCAL, "127.0.0.1"), streams=(1,), seconds=0.1)


def test_agent_serve_exits_when_stdin_closes() -> None:
    import sys
    proc = subprocess.Popen([sys.executable, "-m", "disagg._probe_agent", "serve", "--bind", "127.0.0.1"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().startswith("PROBE-READY ")
        assert proc.stdin is not None
        proc.stdin.close()
        assert proc.wait(timeout=5) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]
