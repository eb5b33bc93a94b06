"""Running :mod:`disagg._doctor_agent` on every participant at once and collecting what each says.

Each agent is one process: ``sh -c WRAPPER`` here, or the same wrapper as the remote command of
the host's ssh line (:func:`disagg.ssh.ssh_prefix`). The wrapper runs the host's Python with the
agent's source as ``-c``, or, when that Python is missing, the first ``python3``/``python`` on the
host's PATH (the agent then says so, and the other checks still run). All agents start together;
interactive runs wait until every agent is ready (its listeners open), then send each its
``GO`` line with the addresses to connect to, so one round trip per host covers the whole check.
"""

from __future__ import annotations

import json
import queue
import shlex
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from disagg import _doctor_agent
from disagg.doctor.plan import Participant, Reach
from disagg.ssh import ssh_prefix

NO_PYTHON = "DOCTOR-NOPYTHON"
_WRAPPER = (
    'P={py}; S={src}; R={req}\n'
    'if command -v "$P" >/dev/null 2>&1; then exec "$P" -c "$S" "$R"; fi\n'
    'for c in python3 python; do\n'
    '  if command -v "$c" >/dev/null 2>&1; then exec "$c" -c "$S" "$R" fallback; fi\n'
    'done\n'
    f'echo {NO_PYTHON}; exit 3\n'
)


def agent_source() -> str:
    """The agent's source text, sent as ``python -c``."""
    return Path(_doctor_agent.__file__).read_text()


def agent_argv(part: Participant) -> list[str]:
    """The command that runs the agent for ``part`` (locally, or over the host's ssh line)."""
    script = _WRAPPER.format(py=shlex.quote(part.python), src=shlex.quote(agent_source()),
                             req=shlex.quote(json.dumps(part.request)))
    if part.is_remote:
        assert part.host is not None
        return [*ssh_prefix(part.host), script]
    return ["sh", "-c", script]


@dataclass
class AgentRun:
    """One agent's process and what it said."""

    part: Participant
    proc: subprocess.Popen[str] | None = None
    lines: queue.Queue[tuple[float, str | None]] = field(default_factory=queue.Queue)
    ready: dict[str, Any] | None = None
    done: dict[str, Any] | None = None
    clock: float | None = None
    #: this machine's clock when GO was written and when the agent's clock line arrived
    sent_at: float | None = None
    clock_at: float | None = None
    error: str | None = None
    stderr: list[str] = field(default_factory=list)
    readers: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        try:
            self.proc = subprocess.Popen(agent_argv(self.part), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True, bufsize=1)
        except OSError as exc:
            self.error = f"could not start the agent: {exc}"
            return
        self.readers = [threading.Thread(target=self._read, daemon=True),
                        threading.Thread(target=self._read_err, daemon=True)]
        for reader in self.readers:
            reader.start()

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put((time.time(), line.rstrip("\n")))
        self.lines.put((time.time(), None))

    def _read_err(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line.rstrip("\n"))

    def expect(self, tag: str, deadline: float) -> tuple[float, str] | None:
        """The payload of the next line starting with ``tag`` (and when it came), or None (error set)."""
        while self.error is None:
            try:
                at, line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.error = f"no answer within the time allowed (waiting for {tag})"
                return None
            if line is None:
                self._failed(tag)
                return None
            if line == NO_PYTHON:
                self.error = f"no Python on this host: {self.part.python} is missing and so are python3 and python"
                return None
            if line.startswith(tag + " "):
                return at, line[len(tag) + 1:]
        return None

    def _failed(self, tag: str) -> None:
        if self.proc is not None:
            try:
                self.proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
        code = self.proc.returncode if self.proc is not None else None
        tail = " / ".join(line for line in self.stderr[-3:] if line.strip())
        self.error = (f"the agent exited ({code}) before {tag}" + (f": {tail}" if tail else "")
                      + (" (ssh could not reach the host)" if code == 255 and self.part.is_remote else ""))

    def send(self, text: str) -> bool:
        if self.proc is None or self.proc.stdin is None:
            return False
        try:
            self.proc.stdin.write(text)
            self.proc.stdin.flush()
            return True
        except (BrokenPipeError, OSError, ValueError):
            self.error = self.error or "the agent stopped reading"
            return False

    def finish(self) -> None:
        if self.proc is None:
            return
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for reader in self.readers:
            reader.join(timeout=2)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


def _port_entry(run: AgentRun, label: str) -> dict[str, Any] | None:
    for entry in (run.ready or {}).get("ports", []):
        if entry["label"] == label or label in entry.get("aliases", []):
            return dict(entry)
    return None


def connect_targets(runs: dict[str, AgentRun], reach: list[Reach]) -> dict[str, list[list[Any]]]:
    """For each source participant, ``[address, port, label]`` to connect to: a free port's temporary
    listener, or the configured port where something already listens (it still tells reachability)."""
    out: dict[str, list[list[Any]]] = {}
    for r in reach:
        target = runs.get(r.target)
        if target is None or target.ready is None or target.part.address is None:
            continue
        entry = _port_entry(target, r.label)
        if entry is None:
            continue
        port = entry.get("listening") or entry.get("port")
        if port:
            out.setdefault(r.source, []).append([target.part.address, port, r.label])
    return out


def run_agents(parts: list[Participant], reach: list[Reach], *, timeout: float) -> dict[str, AgentRun]:
    """Start every agent, let each look at its host, then (interactive requests) have each connect to
    the others' listeners; returns every participant's run, errors included (never raises)."""
    runs = {p.name: AgentRun(p) for p in parts}
    deadline = time.monotonic() + timeout
    for run in runs.values():
        run.start()
    try:
        for run in runs.values():
            got = run.expect(_doctor_agent.READY, deadline)
            if got is not None:
                run.ready = json.loads(got[1])
        interactive = [r for r in runs.values() if r.ready is not None and r.part.request.get("interactive")]
        targets = connect_targets(runs, reach)
        for run in interactive:
            run.sent_at = time.time()
            run.send(f"GO {json.dumps(targets.get(run.part.name, []))}\n")
            got = run.expect(_doctor_agent.CLOCK, deadline)
            if got is not None:
                run.clock_at, run.clock = got[0], float(got[1])
        for run in interactive:
            if run.error is None:
                got = run.expect(_doctor_agent.DONE, deadline)
                if got is not None:
                    run.done = json.loads(got[1])
    finally:
        for run in runs.values():
            run.finish()
    return runs
