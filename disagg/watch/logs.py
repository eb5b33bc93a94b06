"""``disagg logs``: the logs of a run's processes, wherever they run, once or followed.

Callers: :mod:`disagg.commands.watch`. Every log is read with ``tail`` (``tail -n N``, followed:
``tail -n N -F``): a local process's on this machine, a remote engine's on its host over the ssh
command line its state record holds (the one ``disagg up`` started it with). Several logs followed
at once are interleaved line by line, each line prefixed with its process's name.
"""

from __future__ import annotations

import queue
import shlex
import subprocess
import threading
from dataclasses import dataclass
from typing import IO, TextIO

from disagg.errors import DisaggError
from disagg.launch.state import RunState
from disagg.paths import LOGS, run_path
from disagg.topology import Timeouts

#: the detached supervisor's log (``disagg up --detach``), in the run's log directory
SUPERVISOR = "supervisor"
SUPERVISOR_LOG = "supervisor.log"
DEFAULT_LINES = 50


class LogsError(DisaggError):
    """No process of the run matches what was asked for."""


@dataclass(frozen=True)
class LogSource:
    """One process's log: where it is, and how to reach it."""

    name: str
    host: str
    path: str
    ssh: tuple[str, ...] | None = None     # the ssh argv prefix of a remote process

    @property
    def role(self) -> str:
        """``prefill[0]`` -> ``prefill``; ``proxy`` and ``supervisor`` are their own role."""
        return self.name.partition("[")[0]

    def argv(self, lines: int, follow: bool) -> list[str]:
        """The ``tail`` command line for this log (through ssh for a remote one)."""
        tail = ["tail", "-n", str(lines), *(["-F"] if follow else []), "--", self.path]
        return [*self.ssh, shlex.join(tail)] if self.ssh else tail


def sources(run: RunState, which: str | None = None) -> list[LogSource]:
    """The logs of ``run``'s processes (and its supervisor's, when it wrote one) whose role or
    name is ``which`` (None: all); LogsError naming the choices when none is."""
    found = [LogSource(rec.name, rec.host, rec.log, tuple(rec.ssh) if rec.ssh else None) for rec in run.processes]
    supervisor = run_path(run.run_dir, run.name) / LOGS / SUPERVISOR_LOG
    if supervisor.exists():
        found.append(LogSource(SUPERVISOR, "local", str(supervisor)))
    if which is None:
        return found
    chosen = [s for s in found if which in (s.name, s.role)]
    if not chosen:
        names = sorted({s.role for s in found} | {s.name for s in found})
        raise LogsError(f"run {run.name} has no process named or of role {which!r}; choose one of: "
                        + ", ".join(names))
    return chosen


def show(chosen: list[LogSource], out: TextIO, *, lines: int = DEFAULT_LINES,
         timeout: float = Timeouts.ssh_check) -> int:
    """The last ``lines`` lines of each log, under a header naming it; 1 when one could not be read."""
    failed = 0
    for i, src in enumerate(chosen):
        where = f"{src.host}:{src.path}" if src.ssh else src.path
        out.write(("\n" if i else "") + f"==> {src.name} ({where}) <==\n")
        try:
            done = subprocess.run(src.argv(lines, False), capture_output=True, text=True, errors="replace",
                                  timeout=timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            out.write(f"(no answer from {src.host} within {timeout:g} s)\n")
            failed += 1
            continue
        except OSError as exc:
            out.write(f"(cannot run {src.argv(lines, False)[0]}: {exc.strerror or exc})\n")
            failed += 1
            continue
        out.write(done.stdout)
        if done.returncode != 0:
            out.write(f"(could not read {where}: {done.stderr.strip() or f'exit status {done.returncode}'})\n")
            failed += 1
        out.flush()
    return 1 if failed else 0


def _pump(name: str, stream: IO[str], lines: queue.Queue[tuple[str, str | None]]) -> None:
    """Copy one child's lines to the queue; ``None`` once it closes."""
    for line in stream:
        lines.put((name, line))
    lines.put((name, None))


def follow(chosen: list[LogSource], out: TextIO, *, lines: int = DEFAULT_LINES) -> int:
    """Follow every log (``tail -F``) until interrupted or every tail has ended; several logs'
    lines are prefixed with their process's name. Returns 1 when a tail ended on its own (a
    host that dropped the connection, a missing ``tail``), after saying so."""
    pending: queue.Queue[tuple[str, str | None]] = queue.Queue()
    children: dict[str, subprocess.Popen[str]] = {}
    width = max(len(s.name) for s in chosen)
    try:
        for src in chosen:
            try:
                child = subprocess.Popen(src.argv(lines, True), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, text=True, errors="replace")
            except OSError as exc:
                raise LogsError(f"cannot follow {src.name}'s log: {exc.strerror or exc}") from exc
            children[src.name] = child
            assert child.stdout is not None
            threading.Thread(target=_pump, args=(src.name, child.stdout, pending), daemon=True).start()
        open_ = len(children)
        while open_:
            try:
                name, line = pending.get(timeout=0.5)   # a timeout keeps Ctrl-C prompt
            except queue.Empty:
                continue
            if line is None:
                open_ -= 1
                code = children[name].wait()
                out.write(f"({name}: tail ended, exit status {code})\n")
                out.flush()
                continue
            out.write(f"{name:<{width}} | {line}" if len(chosen) > 1 else line)
            out.flush()
        return 1
    finally:
        for child in children.values():
            if child.poll() is None:
                child.terminate()
        for child in children.values():
            try:
                child.wait(timeout=5)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
