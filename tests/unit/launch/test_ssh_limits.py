"""The limits of single ssh commands come from the topology (``timeouts.ssh_command`` and
``timeouts.ssh_check``): every remote command the launcher and ``disagg status`` run gets one."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from disagg.commands import lifecycle
from disagg.deployment import build_deployment
from disagg.errors import HostUnreachableError
from disagg.launch import health, processes
from disagg.launch.launcher import Launcher
from disagg.launch.state import ProcessRecord, RunState, save_state
from disagg.topology import Timeouts
from tests.unit.launch.standins import remote_lmcache_topology


def _launcher(tmp_path: Path, timeouts: str = "") -> Launcher:
    return Launcher(build_deployment(remote_lmcache_topology(tmp_path, timeouts)), echo=lambda _: None)


class _Ssh:
    """Stands in for ssh: records (command, limit) and answers as a healthy remote host would."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float]] = []

    def __call__(self, prefix: list[str], command: str, *, timeout: float, stdin_text: str | None = None) -> str:
        self.calls.append((command, timeout))
        if "disagg-liveness" in command:
            return "disagg-liveness running\n"
        return "4242\n" if "setsid" in command else ""


@pytest.fixture
def ssh(monkeypatch: pytest.MonkeyPatch) -> _Ssh:
    fake = _Ssh()
    monkeypatch.setattr(processes, "run_remote", fake)
    monkeypatch.setattr(health, "run_remote", fake)
    return fake


def _remote_record() -> ProcessRecord:
    return ProcessRecord(name="prefill[0]", kind="engine", host="p", address="10.0.0.1", port=8100,
                         url="http://10.0.0.1:8100", log="/tmp/remote/p.log", pid=4242,
                         ssh=["ssh", "me@p"])


def _limits_of_each_step(launcher: Launcher, ssh: _Ssh) -> list[float]:
    """Run each remote step once; the limit each ssh command got, in order."""
    eng = launcher.dep.role("prefill")[0]
    launcher._check_ports()           # busy ports: ssh_command
    launcher._write_files(eng)        # the LMCache file: ssh_command
    launcher._spawn_engine(eng, fresh_log=True)   # setsid ...: ssh_command
    rec = _remote_record()
    assert launcher.processes.alive(rec)   # ssh_check
    launcher.processes.log_tail(rec)   # ssh_check
    return [limit for _, limit in ssh.calls]


def test_the_defaults_are_60_s_per_command_and_20_s_per_check(tmp_path: Path, ssh: _Ssh) -> None:
    assert (Timeouts().ssh_command, Timeouts().ssh_check) == (60.0, 20.0)
    assert _limits_of_each_step(_launcher(tmp_path), ssh) == [60.0, 60.0, 60.0, 20.0, 20.0]


def test_a_topology_sets_both_limits(tmp_path: Path, ssh: _Ssh) -> None:
    launcher = _launcher(tmp_path, "timeouts: {ssh_command: 2m, ssh_check: 7}\n")
    assert (launcher.topo.timeouts.ssh_command, launcher.topo.timeouts.ssh_check) == (120.0, 7.0)
    assert _limits_of_each_step(launcher, ssh) == [120.0, 120.0, 120.0, 7.0, 7.0]


def test_disagg_status_checks_with_the_topology_limit(tmp_path: Path, ssh: _Ssh,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    launcher = _launcher(tmp_path, "timeouts: {ssh_check: 3s}\n")
    save_state(RunState(topology=launcher.topo.file, name="lm", run_dir=launcher.topo.run_dir,
                        proxy_url="http://10.0.0.9:8000", started_at=0.0, up_pid=0,
                        processes=[_remote_record()]))
    monkeypatch.setattr(lifecycle, "http_status", lambda url, timeout=3.0: 200)
    args = argparse.Namespace(topology=launcher.topo.file, run_dir=str(tmp_path / "run"))
    lifecycle.cmd_status(args)
    assert "prefill[0]" in capsys.readouterr().out
    assert [limit for _, limit in ssh.calls] == [3.0]


def test_a_command_past_its_limit_means_the_host_is_unreachable() -> None:
    with pytest.raises(HostUnreachableError, match=r"^-c: no answer within 0\.2 s$"):
        processes.run_remote(["sh", "-c"], "sleep 5", timeout=0.2)
