"""Secrets (the socket connector's, the engine key) reach a remote engine over ssh's stdin, never
a command line.

A real sshd in a network namespace stands for the remote host
(``tests/e2e/sshhost.py``); ``start_remote`` starts a small shell command
there the way the launcher starts an engine. The command writes the variable
it received to a file; every process in the namespace (sshd's session, the
shell, the command) is checked for the secret in its command line while the
command still runs. The second test goes through the launcher: a remote
"engine" of a planned vLLM topology receives the run's engine key in
``VLLM_API_KEY`` while the plan's public variables stay on the command line.
Skips only without namespaces or without OpenSSH.
"""

from __future__ import annotations

import dataclasses
import secrets
import sys
import textwrap
import time
from pathlib import Path

import pytest

from disagg.deployment import build_deployment
from disagg.launch import processes
from disagg.launch.launcher import Launcher
from disagg.launch.state import ProcessRecord
from disagg.topology import HostSpec, load_topology
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


def test_the_engine_key_travels_on_stdin_to_a_remote_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"no namespaced sshd here: {reason}")
    monkeypatch.delenv("DISAGG_ENGINE_KEY", raising=False)
    out = tmp_path / "received"
    with ssh_namespace(tmp_path / "ssh") as remote:
        topo = tmp_path / "t.yaml"
        topo.write_text(textwrap.dedent(f"""\
            model: {{path: /models/m}}
            link: {{type: ethernet}}
            hosts:
              near: {{address: 198.18.5.1}}
              far:
                address: {remote.address}
                ssh: {remote.user}@{remote.address}
                ssh_port: {remote.port}
                ssh_key: {remote.key}
                ssh_options: [UserKnownHostsFile={tmp_path / "known_hosts"}]
                python: {sys.executable}
                workdir: {tmp_path / "remote"}
            roles:
              prefill: [{{host: far, port: 8100}}]
              decode: [{{host: near, port: 8200}}]
            """))
        dep = build_deployment(load_topology(topo, run_dir=str(tmp_path / "run")))
        launcher = Launcher(dep, echo=lambda _: None)
        key = launcher.engine_key
        assert key
        # The planned engine, with a stand-in command: it records its key and one public variable.
        eng = dep.role("prefill")[0]
        probe = (f"sh -c 'printf %s \"$VLLM_API_KEY $VLLM_CPU_KVCACHE_SPACE\" > {out}; exec sleep 30' "
                 + " ".join(eng.argv[1:]))
        eng = dataclasses.replace(eng, argv=("sh", "-c", f"exec {probe}"))
        sent: list[tuple[str, str | None]] = []
        real_run_remote = processes.run_remote

        def run_remote(prefix, command, **kw):  # the real ssh, recorded
            sent.append((command, kw.get("stdin_text")))
            return real_run_remote(prefix, command, **kw)

        monkeypatch.setattr(processes, "run_remote", run_remote)
        launcher._extra_env = launcher._engine_key_env()  # what up() hands every (re)start
        pending = launcher._start_engine(eng)
        rec = pending.record
        try:
            deadline = time.monotonic() + 15
            while not (out.exists() and out.read_text()) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert out.read_text() == f"{key} 1"  # the key, and the plan's env as before
            assert not any(key in line for line in _cmdlines(remote.namespace_pids()))
            (script, stdin_text), = [(c, i) for c, i in sent if "setsid" in c]
            assert stdin_text == f"{key}\n" and key not in script
            assert "VLLM_CPU_KVCACHE_SPACE=1" in script  # the plan's public variables stay on the command line
            assert "disagg_connectors.engine_guard.EngineGuard" in script
        finally:
            processes.stop_process(rec, grace=2.0)
        assert not processes.is_alive(rec)
