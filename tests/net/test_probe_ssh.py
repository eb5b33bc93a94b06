"""probe-link to a remote decode host over SSH, across an emulated link.

As measured here: an sshd inside one namespace of an EmulatedLink is a
remote host on this machine. The prefill side (this test's probe) runs inside
the other namespace, so the receiver starts over SSH and the data crosses the
tbf-shaped veth. Skips only without namespaces or without OpenSSH.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import disagg
from disagg.linkemu import EmulatedLink, netns_unavailable_reason

pytestmark = pytest.mark.netns

SSHD = "/usr/sbin/sshd"
PORT = 2222
PROBE = """
import json, sys
from disagg.probe import probe_topology
from disagg.topology import load_topology
m = probe_topology(load_topology(sys.argv[1]), streams=(1,), seconds=1.5)
print(json.dumps(m.to_json()))
"""


@pytest.fixture(scope="module", autouse=True)
def _need_netns_and_ssh() -> None:
    reason = netns_unavailable_reason()
    if reason is not None:
        pytest.skip(f"cannot create network namespaces here: {reason}")
    if not (os.path.exists(SSHD) and shutil.which("ssh") and shutil.which("ssh-keygen")):
        pytest.skip("OpenSSH (sshd, ssh, ssh-keygen) is not installed")


def _keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)


def test_probe_link_over_ssh(tmp_path: Path) -> None:
    _keygen(tmp_path / "host_key")
    _keygen(tmp_path / "client_key")
    shutil.copy(tmp_path / "client_key.pub", tmp_path / "authorized_keys")
    # the remote side must import this checkout's disagg: a python wrapper
    root = Path(disagg.__file__).resolve().parent.parent
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={root} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)
    with EmulatedLink(1e9) as link:
        config = tmp_path / "sshd_config"
        config.write_text(textwrap.dedent(f"""\
            Port {PORT}
            ListenAddress {link.b.address}
            HostKey {tmp_path / "host_key"}
            AuthorizedKeysFile {tmp_path / "authorized_keys"}
            PasswordAuthentication no
            StrictModes no
            UsePAM no
            PidFile {tmp_path / "sshd.pid"}
            """))
        sshd = link.popen("b", [SSHD, "-D", "-f", str(config), "-E", str(tmp_path / "sshd.log")])
        try:
            known = tmp_path / "known_hosts"
            key = (tmp_path / "host_key.pub").read_text().split()
            known.write_text(f"[{link.b.address}]:{PORT} {key[0]} {key[1]}\n")
            topo = tmp_path / "remote.yaml"
            topo.write_text(textwrap.dedent(f"""\
                model: meta-llama/Llama-3.1-8B-Instruct
                link: {{type: ethernet, rate: 1gbit}}
                hosts:
                  p: {{address: {link.a.address}}}
                  d: {{address: {link.b.address}, ssh: root@{link.b.address}, ssh_port: {PORT},
                      ssh_key: {tmp_path / "client_key"}, python: {python},
                      ssh_options: ["UserKnownHostsFile={known}", "StrictHostKeyChecking=yes"]}}
                roles:
                  prefill: [{{host: p, port: 8100}}]
                  decode: [{{host: d, port: 8200}}]
                """))
            deadline = time.monotonic() + 10
            while not (tmp_path / "sshd.pid").exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            # only what a user can say: the topology's ssh_options (known_hosts, strict checking)
            done = link.run("a", [sys.executable, "-c", PROBE, str(topo)],
                            capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(root)})
            assert done.returncode == 0, done.stderr + (tmp_path / "sshd.log").read_text()
            result = json.loads(done.stdout.strip().splitlines()[-1])
        finally:
            sshd.kill()
            sshd.wait()
    assert result["path"] == "ssh"
    assert result["receiver"] == link.b.address
    assert float(result["streams_bps"]["1"]) == pytest.approx(1e9, rel=0.10)
