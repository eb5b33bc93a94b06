"""Emulated links between real network namespaces (needs root and iproute2).

Skips, with the reason, only when namespaces cannot be created here. Every
namespace a test creates is deleted, which the tests check.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

import disagg
from disagg.cli import main
from disagg.linkemu import EmulatedLink, netns_unavailable_reason
from disagg.measurements import load_link, probe_path
from disagg.topology import parse_rate

pytestmark = pytest.mark.netns


@pytest.fixture(scope="module", autouse=True)
def _need_netns() -> None:
    reason = netns_unavailable_reason()
    if reason is not None:
        pytest.skip(f"cannot create network namespaces here: {reason}")


def _namespaces() -> set[str]:
    """Namespaces this test process created (EmulatedLink tags start with our pid); other
    sessions on the machine may create and delete their own meanwhile."""
    mine = f"disagg-{os.getpid() % 100000}x"
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.startswith(mine)}


def test_link_is_shaped_on_both_ends_and_removed() -> None:
    before = _namespaces()
    assert before == set()
    with EmulatedLink(parse_rate("1gbit")) as link:
        assert {link.a.namespace, link.b.namespace} <= _namespaces()
        for side in ("a", "b"):
            qdisc = link.run(side, ["tc", "qdisc", "show"], capture_output=True, text=True, check=True).stdout
            assert "tbf" in qdisc and "rate 1Gbit" in qdisc
        code = f"import socket; socket.create_connection(('{link.b.address}', 9), 2)"
        hello = link.run("a", ["python3", "-c", code], capture_output=True, text=True)
        assert "refused" in hello.stderr.lower()   # b answered (RST) over the veth: the path exists
    assert _namespaces() == before
    link.close()   # idempotent


def test_namespaces_are_removed_when_the_body_raises() -> None:
    before = _namespaces()
    with pytest.raises(RuntimeError), EmulatedLink(1e9):
        raise RuntimeError("boom")
    assert _namespaces() == before


TOPOLOGY = """\
model: meta-llama/Llama-3.1-8B-Instruct
link: {{type: emulated, rate: {rate}}}
hosts:
  p: {{address: 198.18.20.1, device: cuda, gpu: rtx-4090}}
  d: {{address: 198.18.20.2, device: cuda, gpu: rtx-4090, kv_memory_gb: 10}}
roles:
  prefill: [{{host: p, port: 8100}}]
  decode: [{{host: d, port: 8200}}]
"""


@pytest.mark.parametrize("rate", ["1gbit", "2.5gbit"])
def test_probe_link_measures_the_shaped_rate(tmp_path, capsys: pytest.CaptureFixture[str], rate: str) -> None:
    """probe-link across a tbf-shaped veth measures within 10% of the shaped rate; plan then uses it."""
    before = _namespaces()
    topo = tmp_path / "emu.yaml"
    topo.write_text(TOPOLOGY.format(rate=rate))
    assert main(["probe-link", str(topo), "--seconds", "2", "--streams", "1,4"]) == 0
    assert _namespaces() == before
    measured = load_link(topo)
    assert measured is not None and probe_path(topo).is_file()
    shaped = parse_rate(rate)
    assert measured.best_bps == pytest.approx(shaped, rel=0.10), measured.streams_bps
    assert 0 < measured.rtt_s < 0.05
    capsys.readouterr()
    assert main(["plan", str(topo), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["link"]["measured"] is True and plan["link"]["usable_bps"] == measured.best_bps


def test_without_root_the_error_says_so() -> None:
    """An unprivileged user gets a LinkError naming the command and the missing rights."""
    setpriv, python = shutil.which("setpriv"), "/usr/bin/python3"   # the venv may be unreadable to nobody
    if setpriv is None or not os.path.exists(python):
        pytest.skip("needs setpriv and /usr/bin/python3 to run as an unprivileged user")
    root = Path(disagg.__file__).resolve().parent.parent
    code = ("from disagg.linkemu import EmulatedLink\n"
            "try:\n    EmulatedLink(1e9, tag='noroot').open()\n"
            "except Exception as exc:\n    print(type(exc).__name__, exc)\n")
    done = subprocess.run([setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", "env",
                           f"PYTHONPATH={root}", python, "-c", code], capture_output=True, text=True, timeout=30)
    assert done.stdout.startswith("LinkError creating network namespace disagg-noroot-a: `ip netns add"), done
    assert "need root" in done.stdout
