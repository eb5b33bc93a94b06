"""`disagg probe-link` over loopback: prints, stores next to the topology, and plan uses it."""

from __future__ import annotations

import json

import pytest

from disagg.cli import main
from disagg.measurements import probe_path

TOPOLOGY = """\
model: disagg:tiny
hosts: {local: {address: 127.0.0.1}}
roles: {prefill: [{port: 8100}], decode: [{port: 8200}]}
"""


def test_probe_link_stores_and_plan_reads(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    topo = tmp_path / "here.yaml"
    topo.write_text(TOPOLOGY)
    assert main(["probe-link", str(topo), "--seconds", "0.2", "--streams", "1,2"]) == 0
    out = capsys.readouterr().out
    assert "1 stream" in out and "2 streams" in out and "round trip" in out
    stored = json.loads(probe_path(topo).read_text())
    assert set(stored["streams_bps"]) == {"1", "2"}
    assert main(["plan", str(topo), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["link"]["measured"] is True


@pytest.mark.parametrize(("argv", "message"), [(["--streams", "0"], "--streams"),
                                               (["--seconds", "0"], "--seconds must be positive")])
def test_bad_arguments(tmp_path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    topo = tmp_path / "here.yaml"
    topo.write_text(TOPOLOGY)
    assert main(["probe-link", str(topo), *argv]) == 2
    assert message in capsys.readouterr().err


def test_colocated_topology_has_no_link(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["probe-link", "topologies/colocated.yaml"]) == 2
    assert "colocated" in capsys.readouterr().err
