"""A proxy of a test's own in front of a running deployment's engines: no engines of its own.

A deployment that differs from a running one only in what the proxy reads (the routing policy,
the proxy's timeouts and log level, the socket connector's ``streaming``: which handoff the
proxy runs) needs no engines of its own. :func:`own_topology` writes the running deployment's
topology with other settings and its own proxy port, and refuses settings that would start the
engines any differently (their planned argv, environment or files would change);
:func:`start_own_proxy` starts ``python -m disagg proxy`` with the argv `disagg up` gives the
proxy of that topology (``disagg.launch.frontend.frontend_argv``) and the engine key in the
environment, as `disagg up` does, and waits for its /health. :meth:`OwnProxy.stop` stops it and
says what it left. Used by the e2e tests of the socket connector (tests/e2e).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import yaml

from disagg.deployment import Deployment, build_deployment
from disagg.errors import StateError
from disagg.launch.frontend import frontend_argv
from disagg.launch.state import RunState
from disagg.topology import load_topology
from harness.engines import ENGINE_ENV, ROOT, Running, busy_ports, process_trees, wait_proxy_healthy
from harness.ports import free_port


@dataclass
class OwnProxy(Running):
    """A proxy started by :func:`start_own_proxy` over ``base``'s engines: ``engines`` and
    ``state()`` are the base deployment's, ``process`` and ``proxy_url`` its own."""

    base: Running | None = None
    log: Path | None = None

    def state(self) -> RunState:
        assert self.base is not None
        return self.base.state()

    def process_tree(self) -> list[psutil.Process]:
        """This proxy's processes, then the base deployment's engines (never the base's proxy)."""
        roots = [self.process.pid] if self.process is not None and self.process.poll() is None else []
        try:
            roots += [r.pid for r in self.state().processes if r.kind == "engine"]
        except (OSError, StateError):   # the base deployment is down
            pass
        return process_trees(roots)

    def stop(self, grace_s: float = 20) -> list[str]:
        """SIGTERM to the proxy's process group, SIGKILL after ``grace_s``; what is left of it (none
        of its processes may live on, its port must be free). Idempotent."""
        if self.process is None:
            return []
        procs = [psutil.Process(self.process.pid)] if self.process.poll() is None else []
        procs += [c for p in procs for c in p.children(recursive=True)]
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        _, alive = psutil.wait_procs(procs, timeout=5)
        port = int(self.proxy_url.rsplit(":", 1)[1])
        problems = [f"left running after the proxy was stopped: {[p.pid for p in alive]}"] if alive else []
        problems += [f"the proxy's port {port} is still taken"] if busy_ports([port]) else []
        return problems

    def output(self) -> str:
        """What the proxy wrote so far (its log)."""
        return self.log.read_text(errors="replace") if self.log is not None and self.log.exists() else ""


def _engines_plan(dep: Deployment) -> list[tuple[str, tuple[str, ...], tuple[tuple[str, str], ...], Any]]:
    return [(e.name, e.argv, e.env, e.files) for e in dep.engines]


def own_topology(base: Running, path: Path, settings: dict[str, Any]) -> Path:
    """``base``'s topology file with ``settings`` (top-level keys set, or removed where the value is
    None; a ``connector`` dict merged into the base's) and a proxy port of its own, written to
    ``path``. Raises AssertionError when the settings change how the engines are started."""
    doc = yaml.safe_load(base.topology.read_text())
    for key, value in settings.items():
        if value is None:
            doc.pop(key, None)
        elif key == "connector" and isinstance(doc.get(key), dict):
            doc[key] = {**doc[key], **value}
        else:
            doc[key] = value
    doc["proxy"] = {**doc["proxy"], "port": free_port()}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    mine, theirs = build_deployment(load_topology(path)), build_deployment(load_topology(base.topology))
    assert _engines_plan(mine) == _engines_plan(theirs), (
        f"{sorted(settings)}: not only the proxy's settings; the engines would start otherwise")
    return path


def start_own_proxy(base: Running, topology: Path, timeout_s: float = 120) -> OwnProxy:
    """Start the proxy ``topology`` plans (written by :func:`own_topology`) over ``base``'s engines,
    in a session of its own, its output in ``<topology>.proxy.log``; returns once its /health
    answers 200 (raises AssertionError with its output when it exits or times out first)."""
    dep = build_deployment(load_topology(topology))
    assert {e.name: e.url for e in dep.engines} == base.engines, (dep.engines, base.engines)
    log = topology.with_suffix(".proxy.log")
    with open(log, "wb") as out:
        proc = subprocess.Popen(frontend_argv(dep), stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, **ENGINE_ENV}, start_new_session=True)
    own = OwnProxy(topology, base.run_dir, dep.proxy_url, dict(base.engines), "", proc, base=base, log=log)
    try:
        wait_proxy_healthy(dep.proxy_url, timeout_s, process=proc)
    except AssertionError as exc:
        own.stop()
        raise AssertionError(f"{sys.executable} -m disagg proxy did not come up ({exc}):\n"
                             f"{own.output()[-3000:]}") from None
    return own
