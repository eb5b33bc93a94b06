"""The run-state file: what ``disagg up`` started, so ``down``/``status`` can find it.

One directory per topology name under ``<run_dir>/runs/<name>/`` holds
``state.json`` and the local logs. The file is rewritten atomically after every
process start, so an interrupted ``up`` still leaves enough to stop what it
started.

``save_state`` also records the run directory in the per-user list of live runs
(``disagg.launch.live``) and ``remove_state`` takes it out, so ``status`` and ``down`` find a
run from any directory.

``up.lock`` in the same directory is ``flock``ed by the ``disagg up`` that
owns the run, for as long as that process lives (a foreground ``up`` until it
exits, a detached one until it returns; the engines never inherit it), and
holds its pid. A second ``up`` of the same topology is refused while the lock
is held or the state file lists live processes.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from disagg.errors import NotRunningError, StateError
from disagg.launch import live
from disagg.paths import run_path

STATE_FILE = "state.json"
LOCK_FILE = "up.lock"
#: a process record's ``status``: serving (or starting for the first time), waiting to be
#: restarted, restarted and not yet healthy, exited and not restarted (policy or restart cap)
STATUSES = ("running", "backoff", "starting", "failed")


@dataclass
class ProcessRecord:
    """One started process (engine or proxy)."""

    name: str                       # prefill[0], decode[0], both[0], proxy
    kind: str                       # engine | proxy
    host: str                       # topology host name ("local" for the proxy)
    address: str
    port: int
    url: str
    log: str                        # path of the log on the host that runs it
    pid: int
    create_time: float = 0.0        # local processes: when it started (epoch seconds, wall clock)
    #: local processes: when it started in clock ticks since boot (processes.start_ticks): what
    #: tells it from a recycled pid whatever the wall clock does; 0 in records of older versions
    start_ticks: int = 0
    ssh: list[str] | None = None    # ssh argv prefix for remote processes
    #: written by the supervisor (``Launcher.supervise``): see :data:`STATUSES`
    status: str = "running"
    restarts: int = 0               # times the supervisor started it again
    last_exit: str = ""             # how it last exited: "exit status 1", "killed by SIGKILL", ...
    exit_log: str = ""              # the last lines of its log when it last exited


@dataclass
class RunState:
    """Everything one ``disagg up`` started."""

    topology: str
    name: str
    run_dir: str
    proxy_url: str
    started_at: float
    up_pid: int
    processes: list[ProcessRecord] = field(default_factory=list)
    namespaces: list[str] = field(default_factory=list)   # emulated links: network namespaces to delete
    cgroups: list[str] = field(default_factory=list)      # emulated CPU shares: cgroup directories to remove

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> RunState:
        data = json.loads(text)
        procs = [ProcessRecord(**_known(ProcessRecord, p)) for p in data.pop("processes", [])]
        return cls(**_known(cls, data), processes=procs)


def _known(kind: type, data: dict[str, Any]) -> dict[str, Any]:
    """The fields of ``data`` that ``kind`` has: a state file written by a newer disagg
    (more fields) can still be read, to stop what it lists."""
    names = {f.name for f in fields(kind)}
    return {k: v for k, v in data.items() if k in names}


def save_state(state: RunState) -> Path:
    """Write the state file atomically; returns its path.

    Raises OSError when it cannot be written (a full disk: ENOSPC); the file then keeps its
    previous content, and the partly written temporary file is removed. ``disagg up`` lets that
    fail its start (``down`` needs the file); its supervisor and every stop carry on without it
    (``Launcher.save``, ``launcher.stop_run``)."""
    directory = run_path(state.run_dir, state.name)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / STATE_FILE
    tmp = target.with_suffix(".tmp")
    try:
        tmp.write_text(state.to_json(), encoding="utf-8")
        os.replace(tmp, target)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    live.register(directory)  # so `status` and `down` find it from any directory
    return target


def load_state(path: str | Path) -> RunState:
    """Read a state file; StateError when missing or corrupt."""
    try:
        return RunState.from_json(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise NotRunningError(f"no run state at {path}: nothing was started with this topology "
                         "(or it was already stopped)") from exc
    except (OSError, ValueError, TypeError) as exc:
        raise StateError(f"run state {path} is unreadable: {exc}") from exc


def remove_state(state: RunState) -> None:
    """Delete the state file (logs stay for inspection)."""
    (run_path(state.run_dir, state.name) / STATE_FILE).unlink(missing_ok=True)
    live.unregister(run_path(state.run_dir, state.name))


def find_states(run_dir: str | Path) -> list[Path]:
    """Every state file under ``run_dir``."""
    return sorted((Path(run_dir) / "runs").glob(f"*/{STATE_FILE}"))


def live_states(run_dir: str | Path) -> list[Path]:
    """Every state file of this user's live runs: those under ``run_dir`` (the current directory's
    ``.disagg`` when the command names none) and those in the per-user list (``disagg.launch.live``),
    each once, in name order."""
    found: dict[Path, Path] = {}
    for path in [*find_states(run_dir), *(run / STATE_FILE for run in live.live_runs())]:
        found.setdefault(path.resolve(), path)
    return sorted(found.values(), key=lambda p: (p.parent.name, str(p)))


class RunLock:
    """The ``up.lock`` of one run directory (see the module docstring)."""

    def __init__(self, run_dir: str | Path, name: str) -> None:
        self.path = run_path(run_dir, name) / LOCK_FILE
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """True while this object holds the lock."""
        return self._fd is not None

    def acquire(self, *, record_pid: bool = True) -> int | None:
        """Take the lock without waiting: None when taken, else the holder's pid (0 if unknown)."""
        if self._fd is not None:
            return None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _read_pid(fd)
            os.close(fd)
            return holder
        if record_pid:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return None

    def release(self) -> None:
        """Give the lock back (idempotent); the file stays, empty locks cost nothing."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if _read_pid(fd) == os.getpid():
                os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def lock_holder(run_dir: str | Path, name: str) -> int | None:
    """The pid of the ``disagg up`` holding a run's lock (0 if it wrote none yet), or None when free."""
    probe = RunLock(run_dir, name)
    if not probe.path.exists():
        return None
    holder = probe.acquire(record_pid=False)
    probe.release()
    return holder


def _read_pid(fd: int) -> int:
    try:
        return int(os.pread(fd, 32, 0).decode().strip() or 0)
    except (OSError, ValueError):
        return 0
