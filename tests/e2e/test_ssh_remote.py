"""An engine on a "remote" host reached over SSH (a network namespace with its
own address running sshd): `disagg up` starts it there, logs stay there and
are fetched on failure, a remote engine that dies is restarted there by the detached supervisor
(shown by `disagg status` and the supervisor's log), `disagg down` kills the remote process group."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from harness.engines import Running, bring_up, disagg, free_ports, post_json, wait_proxy_healthy
from tests.e2e.sshhost import SshHost, ssh_namespace, unavailable_reason

pytestmark = [pytest.mark.e2e, pytest.mark.netns,
              pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))]


@pytest.fixture(scope="module")
def remote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshHost]:
    with ssh_namespace(tmp_path_factory.mktemp("sshd")) as host:
        yield host


def _remote_topology(path: Path, model: Path, host: SshHost, port: int, proxy_port: int, workdir: Path) -> Path:
    path.write_text(textwrap.dedent(f"""\
        model: {{path: {model}, max_model_len: 4096, served_name: tiny}}
        hosts:
          far:
            address: {host.address}
            ssh: {host.user}@{host.address}
            ssh_port: {host.port}
            ssh_key: {host.key}
            ssh_options: [UserKnownHostsFile={workdir.parent / "known_hosts"}]
            python: {sys.executable}
            workdir: {workdir}
        roles:
          both: [{{host: far, port: {port}, cpus: [0, 1], args: [-O0]}}]
        proxy: {{host: 127.0.0.1, port: {proxy_port}}}
        timeouts: {{startup: 400}}
        """))
    return path


def test_engine_over_ssh(engine_lock: None, remote: SshHost, tiny_model: Path, reference: dict[str, str],
                         requests_: dict[str, dict], tmp_path: Path) -> None:
    port, proxy_port = free_ports(2)
    workdir = tmp_path / "remote-workdir"
    topo = _remote_topology(tmp_path / "remote.yaml", tiny_model, remote, port, proxy_port, workdir)
    run: Running = bring_up(topo, tmp_path / "run")
    try:
        record = next(r for r in run.state().processes if r.kind == "engine")
        assert record.ssh is not None and record.ssh[-1] == f"root@{remote.address}"
        assert record.pid in remote.namespace_pids()  # it really runs on the "remote" host
        assert (workdir / "runs" / "remote" / "logs" / "both-0.log").is_file()  # logs kept there
        reply = post_json(run.proxy_url + "/v1/completions", requests_["short"])
        assert reply["choices"][0]["text"] == reference["short"]
        status = disagg("status", str(topo), "--run-dir", str(run.run_dir))
        assert status.returncode == 0 and "via ssh" in status.stdout and "healthy" in status.stdout

        # the remote API server dies: the detached supervisor sweeps its group over ssh and starts it
        # again there, and stays the run's supervisor
        supervisor = psutil.Process(run.state().up_pid)
        old_group = remote.namespace_pids()
        os.kill(record.pid, signal.SIGKILL)
        deadline = time.monotonic() + 400
        while (again := next(r for r in run.state().processes if r.kind == "engine")).pid == record.pid \
                or again.status != "running":
            assert time.monotonic() < deadline, "the remote engine was not restarted"
            time.sleep(0.5)
        assert again.pid in remote.namespace_pids() and again.restarts == 1
        assert again.last_exit.startswith("exited (status unknown")
        assert supervisor.is_running() and run.state().up_pid == supervisor.pid
        assert not (old_group - {p for p in old_group if _is_sshd(p)}) & remote.namespace_pids()
        wait_proxy_healthy(run.proxy_url)
        reply = post_json(run.proxy_url + "/v1/completions", requests_["short"])
        assert reply["choices"][0]["text"] == reference["short"]
        status = disagg("status", str(topo), "--run-dir", str(run.run_dir))
        assert "restarts 1, last exit: exited (status unknown" in status.stdout
        assert f"supervisor  pid {supervisor.pid}" in status.stdout
        log = run.run_dir / "runs" / topo.stem / "logs" / "supervisor.log"
        assert "both[0]: healthy again after" in log.read_text()
        record = again
    finally:
        done = run.down()
    assert done.returncode == 0, done.stderr
    deadline = time.monotonic() + 15
    while record.pid in remote.namespace_pids() and time.monotonic() < deadline:
        time.sleep(0.2)
    leftover = remote.namespace_pids() - {p for p in remote.namespace_pids() if _is_sshd(p)}
    assert not leftover, f"processes left in the remote namespace: {sorted(leftover)}"


def test_remote_failure_fetches_the_remote_log(engine_lock: None, remote: SshHost, tmp_path: Path) -> None:
    model = tmp_path / "broken"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "no-such-architecture"}')
    port, proxy_port = free_ports(2)
    topo = _remote_topology(tmp_path / "remote-bad.yaml", model, remote, port, proxy_port, tmp_path / "wd")
    done = disagg("up", str(topo), "--detach", "--run-dir", str(tmp_path / "run"), timeout=300)
    assert done.returncode == 2
    assert done.stderr.startswith(f"disagg: error: both[0] on {remote.address}:{port} exited while starting")
    assert "no-such-architecture" in done.stderr
    leftover = remote.namespace_pids() - {p for p in remote.namespace_pids() if _is_sshd(p)}
    assert not leftover


def _is_sshd(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() == "sshd"
    except OSError:
        return False
