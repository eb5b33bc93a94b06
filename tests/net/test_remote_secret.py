"""The socket connector's secret reaches a remote engine over ssh's stdin, never a command line.

A real sshd in a network namespace stands for the remote host
(``tests/e2e/sshhost.py``); ``start_remote`` starts a small shell command
there the way the launcher starts an engine. The command writes the variable
it received to a file; every process in the namespace (sshd's session, the
shell, the command) is checked for the secret in its command line while the
command still runs. Skips only without namespaces or without OpenSSH.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path

import pytest

from disagg.launch import processes
from disagg.launch.state import ProcessRecord
from disagg.topology import HostSpec
from tests.e2e.sshhost import ssh_namespace, unavailable_reason

pytestmark = pytest.mark.netns


def _cmdlines(pids: set[int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            out.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue
    return out


def test_secret_travels_on_stdin_to_a_remote_command(tmp_path: Path) -> None:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"no namespaced sshd here: {reason}")
    secret = secrets.token_hex(32)
    out = tmp_path / "received"
    with ssh_namespace(tmp_path / "ssh") as remote:
        host = HostSpec(name="far", address=remote.address, ssh=f"{remote.user}@{remote.address}",
                        ssh_port=remote.port, ssh_key=str(remote.key),
                        ssh_options=(f"UserKnownHostsFile={tmp_path / 'known_hosts'}",))
        command = f"sh -c 'printf %s \"$DISAGG_KV_SECRET\" > {out}; exec sleep 30'"
        pid = processes.start_remote(host, command, str(tmp_path / "logs" / "cmd.log"),
                                     secret_env={"DISAGG_KV_SECRET": secret})
        rec = ProcessRecord(name="cmd", kind="engine", host="far", address=remote.address, port=1,
                            url="http://x", log=str(tmp_path / "logs" / "cmd.log"), pid=pid,
                            ssh=processes.ssh_prefix(host))
        try:
            deadline = time.monotonic() + 15
            while not (out.exists() and out.read_text()) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert out.read_text() == secret
            assert processes.is_alive(rec)
            lines = _cmdlines(remote.namespace_pids())
            assert any("sleep 30" in line for line in lines)  # the command is there to be seen ...
            assert not any(secret in line for line in lines)  # ... and the secret is not
        finally:
            processes.stop_process(rec, grace=2.0)
        assert not processes.is_alive(rec)
