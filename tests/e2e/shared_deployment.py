"""Deployments shared by several e2e modules, one up at a time on the session's model.

The ``shared_deployment`` fixture (tests/e2e/conftest.py) holds a :class:`SharedDeployment`:
:meth:`~SharedDeployment.get` brings a deployment up by name (stopping the one it held, if
another), or returns the one that runs; :meth:`~SharedDeployment.release` stops it the way it was
started (`disagg down` for a detached run, Ctrl-C for a foreground one) and returns what it left
behind. Two are shared: the NIXL 1P1D (:func:`nixl_deployment`, a foreground `disagg up` as
`make serve` runs it) and the socket 1P1D (:func:`socket_deployment`, detached). Modules that use
one set ``SHARED_DEPLOYMENT`` to its name, and the module whose test releases it
``TAKES_DOWN_SHARED`` to that test's name; conftest runs each deployment's modules one after the
other, that module last and that test at the end, and releases the deployment before any module
that does not use it, so that never more than two engines run, whatever the files' names.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path
from typing import TypeAlias

import psutil

from disagg.errors import StateError
from harness.engines import (
    ENGINE_ARGS,
    SPLIT_EVERY_PROMPT,
    Running,
    bring_up_foreground,
    bring_up_socket_pd,
    busy_ports,
    engine_processes,
    free_ports,
    write_topology,
)

#: the shared deployments' names
NIXL, SOCKET = "nixl", "socket"
#: the NIXL deployment's ``timeouts.liveness``: test_pd's hung prefill engine is killed and
#: restarted once it has failed every probe this long. Above the 10-15 s the proxy takes to put it
#: out of rotation (two timed-out probes), so the proxy sees it hung, not dead; below the default
#: 30 s, so the test waits 10 s less.
PD_LIVENESS_S = 20
#: its ``timeouts.send``: a client reading nothing of its stream this long is let go
SEND_TIMEOUT_S = 5
#: its engines' arguments: the tests' own, without prefix caching (see :func:`socket_deployment`)
NO_PREFIX_CACHE_ARGS = ENGINE_ARGS[:-1] + ', "--no-enable-prefix-caching"]'


def down_problems(run: Running, model: Path) -> list[str]:
    """`disagg down` of ``run``: what it left (processes of the run, its detached supervisor, its
    ports, its state file, any engine on ``model``); [] when nothing."""
    procs = run.process_tree()
    try:
        state = run.state()
    except (OSError, StateError) as exc:
        return [f"no state to take down: {exc}"]
    ports = [r.port for r in state.processes]
    problems = [] if len(procs) >= 3 else [f"engines and proxy were not all running before down: {procs}"]
    try:
        procs.append(psutil.Process(state.up_pid))   # `up --detach`'s supervisor: `down` asks it to stop
    except psutil.Error:
        problems.append(f"the supervisor (pid {state.up_pid}) was not running before down")
    done = run.down()
    if done.returncode != 0:
        problems.append(f"disagg down exited {done.returncode}: {done.stderr[-2000:]}")
    if "still owns this run; asking it to stop" not in done.stdout:
        problems.append(f"disagg down did not stop the supervisor first: {done.stdout[-2000:]}")
    return problems + _left_behind(run, model, procs, ports, "disagg down", wait_s=10)


def _left_behind(run: Running, model: Path, procs: list[psutil.Process], ports: list[int], stop: str,
                 wait_s: float) -> list[str]:
    """What a stop (``stop``: how it was asked) left of ``run``: processes of ``procs`` still
    running after ``wait_s``, ports of ``ports`` still taken, its state file, engines on ``model``."""
    problems = []
    _, alive = psutil.wait_procs(procs, timeout=wait_s)
    if alive:
        problems.append(f"left running after {stop}: {[p.pid for p in alive]}")
    if busy := busy_ports(ports):
        problems.append(f"ports still taken: {busy}")
    if (run.run_dir / "runs" / run.topology.stem / "state.json").exists():
        problems.append("the state file is still there")
    if left := engine_processes(model):
        problems.append(f"engines on the model still run: {[p.pid for p in left]}")
    return problems


def ctrl_c_problems(run: Running, model: Path) -> list[str]:
    """Ctrl-C (SIGINT) to the foreground `disagg up` of ``run``: what it left (its exit status if
    not 0, processes of the run, its ports, its state file, any engine on ``model``); [] when nothing."""
    if run.process is None or run.process.poll() is not None:
        return [f"the foreground disagg up was not running before Ctrl-C: {run.process}"]
    procs = run.process_tree()
    problems = [] if len(procs) >= 3 else [f"engines and proxy were not all running before Ctrl-C: {procs}"]
    ports = [r.port for r in run.state().processes]
    run.process.send_signal(signal.SIGINT)
    if (status := run.process.wait(timeout=120)) != 0:
        problems.append(f"disagg up exited {status} on Ctrl-C")
    return problems + _left_behind(run, model, procs, ports, "Ctrl-C", wait_s=5)


#: how a shared deployment is stopped: the run and the session's model -> what it left
Stop: TypeAlias = Callable[[Running, Path], list[str]]


class SharedDeployment:
    """At most one deployment on ``model``, by name."""

    def __init__(self, model: Path) -> None:
        self.model = model
        self.name: str | None = None
        self.run: Running | None = None
        self._stop: Stop = down_problems

    def get(self, name: str, start: Callable[[], Running], stop: Stop = down_problems) -> Running:
        """The deployment ``name``: the running one, or ``start()``'s once the one held (if any) is
        down; :meth:`release` stops it with ``stop``."""
        if self.run is not None and self.name == name:
            return self.run
        held = self.name
        problems = self.release()
        assert not problems, f"taking down the shared deployment {held}: {problems}"
        self.run, self.name, self._stop = start(), name, stop
        return self.run

    def release(self) -> list[str]:
        """Stop the held deployment the way it was started; what it left. Nothing held: []."""
        if self.run is None:
            return []
        run, self.run, self.name = self.run, None, None
        return self._stop(run, self.model)


def nixl_deployment(shared: SharedDeployment, e2e_dir: Path, model: Path) -> Running:
    """The shared NIXL 1P1D: 1 prefill + 1 decode with NIXL over loopback, one pinned core each,
    behind the proxy a foreground `disagg up` starts (as `make serve` does); released with Ctrl-C.
    ``routing: {policy: split}``: its tests are about the KV handoff, which the default ``auto``
    routing skips for most prompts on one machine; ``timeouts.liveness``: :data:`PD_LIVENESS_S`."""
    def start() -> Running:
        proxy_port, p_port, d_port, p_kv, d_kv = free_ports(5)
        roles = (f"prefill: [{{port: {p_port}, kv_port: {p_kv}, cpus: [0], args: {ENGINE_ARGS}}}]\n"
                 f"decode: [{{port: {d_port}, kv_port: {d_kv}, cpus: [1], args: {ENGINE_ARGS}}}]\n")
        topo = write_topology(e2e_dir / "pd.yaml", model, proxy_port=proxy_port, roles=roles,
                              extra=SPLIT_EVERY_PROMPT + f"timeouts: {{liveness: {PD_LIVENESS_S}}}\n")
        return bring_up_foreground(topo, e2e_dir / "run-pd")
    return shared.get(NIXL, start, stop=ctrl_c_problems)


def socket_deployment(shared: SharedDeployment, e2e_dir: Path, model: Path) -> Running:
    """The shared socket 1P1D: 1 prefill + 1 decode with the socket connector (raw wire format) over
    loopback, one pinned core each, behind the proxy `disagg up` starts: the KV fetched after the
    prefill, every prompt split, a short send timeout (test_socket_conformance's stalled client
    waits it out). test_socket_conformance.py and test_socket_routing_auto.py use it, with proxies
    of their own for the streamed handoff and routing ``auto``. The engines run without prefix
    caching: each proxy sends them the same conformance prompts, and each must move their KV in full
    (with it, the second time round the decode engine's cache held the prompts' full blocks)."""
    def start() -> Running:
        return bring_up_socket_pd(e2e_dir, model, "pd-socket-fetch", args=NO_PREFIX_CACHE_ARGS,
                                  extra=SPLIT_EVERY_PROMPT + f"timeouts: {{send: {SEND_TIMEOUT_S}}}\n")
    return shared.get(SOCKET, start)
