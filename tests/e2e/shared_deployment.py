"""One deployment shared by several e2e modules, up at most once at a time on the session's model.

The ``shared_deployment`` fixture (tests/e2e/conftest.py) holds a :class:`SharedDeployment`:
:meth:`~SharedDeployment.get` brings a deployment up by name (stopping the one it held, if
another), or returns the one that runs; :meth:`~SharedDeployment.release` takes it down with
`disagg down` and returns what it left behind (:func:`down_problems`). Modules that use it set
``SHARED_DEPLOYMENT`` to its name, and the module whose test releases it ``TAKES_DOWN_SHARED``
to that test's name; conftest runs them one after the other, that module last and that test at
the end, and releases it before any other module, so that never more than two engines run.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import psutil

from disagg.errors import StateError
from harness.engines import (
    ENGINE_ARGS,
    SPLIT_EVERY_PROMPT,
    Running,
    bring_up_socket_pd,
    busy_ports,
    engine_processes,
    foreground_up_processes,
)

#: the shared socket deployment's name
SOCKET = "socket"
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
    _, alive = psutil.wait_procs(procs, timeout=10)
    if alive:
        problems.append(f"left running after disagg down: {[p.pid for p in alive]}")
    if busy := busy_ports(ports):
        problems.append(f"ports still taken: {busy}")
    if (run.run_dir / "runs" / run.topology.stem / "state.json").exists():
        problems.append("the state file is still there")
    if left := engine_processes(model):
        problems.append(f"engines on the model still run: {[p.pid for p in left]}")
    return problems


class SharedDeployment:
    """At most one deployment on ``model``, by name."""

    def __init__(self, model: Path) -> None:
        self.model = model
        self.name: str | None = None
        self.run: Running | None = None

    def get(self, name: str, start: Callable[[], Running]) -> Running:
        """The deployment ``name``: the running one, or ``start()``'s once the one held (if any) is down."""
        if self.run is not None and self.name == name:
            return self.run
        held = self.name
        problems = self.release()
        assert not problems, f"taking down the shared deployment {held}: {problems}"
        self.run, self.name = start(), name
        return self.run

    def release(self) -> list[str]:
        """Take the held deployment down (`disagg down`); what it left. Nothing held: []."""
        if self.run is None:
            return []
        run, self.run, self.name = self.run, None, None
        return down_problems(run, self.model)


def socket_deployment(shared: SharedDeployment, e2e_dir: Path, model: Path) -> Running:
    """The shared socket 1P1D: 1 prefill + 1 decode with the socket connector (raw wire format) over
    loopback, one pinned core each, behind the proxy `disagg up` starts: the KV fetched after the
    prefill, every prompt split, a short send timeout (test_socket_conformance's stalled client
    waits it out). test_socket_conformance.py and test_socket_routing_auto.py use it, with proxies
    of their own for the streamed handoff and routing ``auto``. The engines run without prefix
    caching: each proxy sends them the same conformance prompts, and each must move their KV in full
    (with it, the second time round the decode engine's cache held the prompts' full blocks)."""
    def start() -> Running:
        for up in foreground_up_processes(e2e_dir / "pd.yaml"):  # the NIXL `pd`, if test_pd did not stop it
            up.send_signal(signal.SIGINT)
            up.wait(timeout=120)
        return bring_up_socket_pd(e2e_dir, model, "pd-socket-fetch", args=NO_PREFIX_CACHE_ARGS,
                                  extra=SPLIT_EVERY_PROMPT + f"timeouts: {{send: {SEND_TIMEOUT_S}}}\n")
    return shared.get(SOCKET, start)
