"""A "remote host" on this machine: a network namespace with its own address
(198.18.5.2/30) running OpenSSH's sshd, reached by key (docs/launcher.md, SSH hosts).

Commands run through it execute inside the namespace but see the same
filesystem, so the same venv and model path work there.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

SSHD = "/usr/sbin/sshd"
HOST_ADDR, REMOTE_ADDR, PREFIX = "198.18.5.1", "198.18.5.2", 30
SSH_PORT = 2222


@dataclass(frozen=True)
class SshHost:
    namespace: str
    address: str
    port: int
    key: Path
    user: str = "root"

    def namespace_pids(self) -> set[int]:
        out = subprocess.run(["ip", "netns", "pids", self.namespace], capture_output=True, text=True).stdout
        return {int(p) for p in out.split()}


def unavailable_reason() -> str | None:
    """Why a namespaced sshd cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces (not root)"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    if not os.path.exists(SSHD) or shutil.which("ssh-keygen") is None:
        return "openssh-server is not installed (make test installs it when run as root)"
    return None


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True)


@contextmanager
def ssh_namespace(workdir: Path) -> Iterator[SshHost]:
    """Create the namespace + veth + sshd; remove all of it on exit."""
    tag = f"{os.getpid() % 100000}"
    ns, veth_host, veth_ns = f"disagg-ssh-{tag}", f"dsh{tag}a", f"dsh{tag}b"
    workdir.mkdir(parents=True, exist_ok=True)
    host_key, user_key = workdir / "host_key", workdir / "id_ed25519"
    sshd_proc: subprocess.Popen[bytes] | None = None
    try:
        _run("ip", "netns", "add", ns)
        _run("ip", "link", "add", veth_host, "type", "veth", "peer", "name", veth_ns)
        _run("ip", "link", "set", veth_ns, "netns", ns)
        _run("ip", "addr", "add", f"{HOST_ADDR}/{PREFIX}", "dev", veth_host)
        _run("ip", "link", "set", veth_host, "up")
        _run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{REMOTE_ADDR}/{PREFIX}", "dev", veth_ns)
        _run("ip", "netns", "exec", ns, "ip", "link", "set", veth_ns, "up")
        _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        for key in (host_key, user_key):
            _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key))
        (workdir / "authorized_keys").write_text(user_key.with_suffix(".pub").read_text())
        config = workdir / "sshd_config"
        config.write_text("\n".join([
            f"Port {SSH_PORT}", f"ListenAddress {REMOTE_ADDR}", f"HostKey {host_key}",
            f"AuthorizedKeysFile {workdir / 'authorized_keys'}", "PasswordAuthentication no",
            "KbdInteractiveAuthentication no", "PermitRootLogin prohibit-password", "StrictModes no",
            "UsePAM no", f"PidFile {workdir / 'sshd.pid'}", "LogLevel ERROR", ""]))
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)
        sshd_proc = subprocess.Popen(["ip", "netns", "exec", ns, SSHD, "-D", "-e", "-f", str(config)],
                                     stdout=subprocess.DEVNULL, stderr=open(workdir / "sshd.log", "wb"))
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection((REMOTE_ADDR, SSH_PORT), timeout=1).close()
                break
            except OSError:
                if sshd_proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("sshd did not start: " + (workdir / "sshd.log").read_text()) from None
                time.sleep(0.1)
        yield SshHost(namespace=ns, address=REMOTE_ADDR, port=SSH_PORT, key=user_key)
    finally:
        out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
        for pid in out.split():
            try:
                os.kill(int(pid), 9)
            except OSError:
                pass
        if sshd_proc is not None:
            sshd_proc.kill()
            sshd_proc.wait(timeout=10)
        subprocess.run(["ip", "link", "del", veth_host], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
