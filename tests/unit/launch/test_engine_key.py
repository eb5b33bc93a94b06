"""The run's engine key: generated per run (or taken from DISAGG_ENGINE_KEY), in every vLLM
engine's environment (remote ones: over ssh's stdin) and the proxy's, and nowhere else:
not in any argv, not in the state file, not in what `up` prints."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from disagg.deployment import build_deployment
from disagg.engines.vllm import GUARD_MIDDLEWARE
from disagg.errors import LaunchError
from disagg.launch import launcher as launcher_mod
from disagg.launch import processes
from disagg.launch import tracked as tracked_mod
from disagg.launch.launcher import SECRET_ENVS, Launcher, run_engine_key
from disagg.proxy.config import ENGINE_KEY_ENV
from disagg.topology import load_topology
from harness.ports import free_ports


def _topology(tmp_path: Path, *, engine: str = "vllm", kind: str = "builtin", remote: bool = False) -> Path:
    p, d, proxy, kv_p, kv_d = free_ports(5)
    hosts = ("{near: {address: 198.18.9.1}, far: {address: 198.18.9.2, ssh: me@far, workdir: /tmp/w}}" if remote
             else "{near: {address: 127.0.0.1}, far: {address: 127.0.0.1}}")
    path = tmp_path / "k.yaml"
    path.write_text(textwrap.dedent(f"""\
        model: {{path: /models/m}}
        engine: {engine}
        connector: nixl
        link: {{type: {"ethernet" if remote else "loopback"}}}
        hosts: {hosts}
        roles:
          prefill: [{{host: far, port: {p}, kv_port: {kv_p}}}]
          decode: [{{host: near, port: {d}, kv_port: {kv_d}}}]
        proxy: {{port: {proxy}, kind: {kind}}}
        """))
    return path


def _launcher(path: Path, tmp_path: Path, lines: list[str] | None = None) -> Launcher:
    dep = build_deployment(load_topology(path, run_dir=str(tmp_path / "run")))
    return Launcher(dep, echo=(lines.append if lines is not None else lambda _: None), poll_interval=0.01)


def test_a_fresh_key_per_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENGINE_KEY_ENV, raising=False)
    path = _topology(tmp_path)
    keys = {_launcher(path, tmp_path).engine_key for _ in range(3)}
    assert len(keys) == 3 and all(k and len(k) >= 40 for k in keys)  # 256 bits, url-safe


def test_disagg_engine_key_is_used_when_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _topology(tmp_path)
    monkeypatch.setenv(ENGINE_KEY_ENV, "operator-chosen-key")
    assert _launcher(path, tmp_path).engine_key == "operator-chosen-key"
    monkeypatch.setenv(ENGINE_KEY_ENV, "")  # empty: as if unset
    assert _launcher(path, tmp_path).engine_key not in ("", None, "operator-chosen-key")


def test_an_unusable_disagg_engine_key_is_refused_without_echoing_it(tmp_path: Path) -> None:
    topo = load_topology(_topology(tmp_path), run_dir=str(tmp_path))
    for bad in ("has space", "two\nlines", "tab\there", "é-accent"):
        with pytest.raises(LaunchError, match=f"{ENGINE_KEY_ENV} must be printable ASCII") as err:
            run_engine_key(topo, {ENGINE_KEY_ENV: bad})
        assert bad not in str(err.value)


@pytest.mark.parametrize(("engine", "kind"), [("sglang", "builtin"), ("vllm", "vllm-router")])
def test_no_key_where_the_engines_cannot_be_guarded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    engine: str, kind: str) -> None:
    monkeypatch.setenv(ENGINE_KEY_ENV, "operator-chosen-key")
    launcher = _launcher(_topology(tmp_path, engine=engine, kind=kind), tmp_path)
    assert launcher.engine_key is None and launcher.key_env is None
    assert ENGINE_KEY_ENV not in launcher._proxy_env() and launcher._engine_key_env() == {}


class _Started:
    """Fake process starts: what each process would have been given."""

    def __init__(self) -> None:
        self.local: list[tuple[list[str], dict[str, str]]] = []
        self.remote: list[tuple[str, dict[str, str]]] = []

    def start_local(self, argv, env, log):
        self.local.append((list(argv), dict(env)))
        return os.getpid(), 0.0

    def start_remote(self, host, command, log, secret_env=None, **_):
        self.remote.append((command, dict(secret_env or {})))
        return 4242


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> _Started:
    fake = _Started()
    monkeypatch.setattr(processes, "start_local", fake.start_local)
    monkeypatch.setattr(processes, "start_remote", fake.start_remote)
    monkeypatch.setattr(processes, "is_alive", lambda rec, **_: True)
    monkeypatch.setattr(processes, "exit_status", lambda pid: None)
    monkeypatch.setattr(processes, "stop_process", lambda rec, grace, hurry=None, **_: None)
    monkeypatch.setattr(launcher_mod, "busy_ports", lambda host, python, ports, **_: [])
    monkeypatch.setattr(launcher_mod, "http_status", lambda url, timeout=5.0: 200)
    monkeypatch.setattr(tracked_mod, "http_status", lambda url, timeout=5.0: 200)
    return fake


@pytest.mark.parametrize("chosen", [None, "operator-chosen-key"])
def test_up_puts_the_key_in_engine_and_proxy_environments_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, started: _Started, chosen: str | None) -> None:
    if chosen:
        monkeypatch.setenv(ENGINE_KEY_ENV, chosen)
    else:
        monkeypatch.delenv(ENGINE_KEY_ENV, raising=False)
    lines: list[str] = []
    launcher = _launcher(_topology(tmp_path), tmp_path, lines)
    run = launcher.up()
    key = launcher.engine_key
    assert key and (key == chosen or chosen is None)
    (p_argv, p_env), (d_argv, d_env), (proxy_argv, proxy_env) = started.local
    assert p_env["VLLM_API_KEY"] == d_env["VLLM_API_KEY"] == key
    assert proxy_env[ENGINE_KEY_ENV] == key and "VLLM_API_KEY" not in proxy_env
    for argv in (p_argv, d_argv):
        assert argv[argv.index("--middleware") + 1] == GUARD_MIDDLEWARE
    assert proxy_argv[1:4] == ["-m", "disagg", "proxy"]
    assert not any(key in a for a in p_argv + d_argv + proxy_argv)
    state = (Path(run.run_dir) / "runs" / "k" / "state.json").read_text()
    assert key not in state and "VLLM_API_KEY" not in state
    assert not any(key in line for line in lines)
    origin = "from $DISAGG_ENGINE_KEY" if chosen else "generated for this run"
    assert any(line.startswith(f"engine key ({origin}): in VLLM_API_KEY of every engine and "
                               f"{ENGINE_KEY_ENV} of the proxy") for line in lines)


def test_a_remote_engine_gets_the_key_on_ssh_stdin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   started: _Started) -> None:
    monkeypatch.delenv(ENGINE_KEY_ENV, raising=False)
    assert "VLLM_API_KEY" in SECRET_ENVS
    launcher = _launcher(_topology(tmp_path, remote=True), tmp_path)
    launcher.up()
    key = launcher.engine_key
    assert key
    (command, secret_env), = started.remote  # prefill[0] on host far
    assert secret_env == {"VLLM_API_KEY": key}
    assert key not in command and "VLLM_API_KEY" not in command
    assert f"--middleware {GUARD_MIDDLEWARE}" in command
    (_, d_env), (_, proxy_env) = started.local
    assert d_env["VLLM_API_KEY"] == key == proxy_env[ENGINE_KEY_ENV]
