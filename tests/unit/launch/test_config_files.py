"""The launcher writes each engine's config files (LMCache YAML) into the run
directory before the engine starts, where the engine's env points."""

from __future__ import annotations

import textwrap
from pathlib import Path

import yaml

from disagg.deployment import build_deployment
from disagg.launch.launcher import Launcher
from disagg.topology import parse_topology
from tests.unit.launch.standins import remote_lmcache_topology


def test_lmcache_yaml_is_written_where_the_env_points(tmp_path: Path) -> None:
    text = """\
    model: {path: /models/m}
    engine: vllm
    connector: lmcache
    hosts: {h: {address: 127.0.0.1}}
    roles:
      prefill: [{host: h, port: 8100}]
      decode: [{host: h, port: 8200, kv_port: 7300}]
    """
    topo = parse_topology(textwrap.dedent(text), str(tmp_path / "lm.yaml"), run_dir=str(tmp_path / "run"))
    dep = build_deployment(topo)
    launcher = Launcher(dep, echo=lambda line: None)
    for eng in dep.engines:
        launcher._write_files(eng)
        path = Path(dict(eng.env)["LMCACHE_CONFIG_FILE"])
        assert path.parent == tmp_path / "run" / "runs" / "lm"
        assert yaml.safe_load(path.read_text())["pd_role"] == ("sender" if eng.name == "prefill[0]" else "receiver")


def test_remote_files_go_over_ssh_as_one_shell_command(tmp_path: Path, monkeypatch) -> None:
    """The remote write is one `mkdir && printf > file` command; run here by bash it
    reproduces the file byte for byte (quotes and newlines survive)."""
    import subprocess

    from disagg.launch import processes

    dep = build_deployment(remote_lmcache_topology(tmp_path))
    sent: list[tuple[list[str], str]] = []
    monkeypatch.setattr(processes, "run_remote", lambda prefix, cmd, **kw: sent.append((prefix, cmd)) or "")
    eng = dep.role("prefill")[0]
    Launcher(dep, echo=lambda line: None)._write_files(eng)
    (prefix, cmd), = sent
    assert prefix[0] == "ssh" and "me@p" in prefix
    subprocess.run(["bash", "-c", cmd], check=True)
    path = Path(dict(eng.env)["LMCACHE_CONFIG_FILE"])
    assert path == tmp_path / "remote" / "runs" / "lm" / "prefill-0.lmcache.yaml"
    assert path.read_text() == eng.files[0][1]
