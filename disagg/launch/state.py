"""The run-state file: what ``disagg up`` started, so ``down``/``status`` can find it.

One directory per topology name under ``<run_dir>/runs/<name>/`` holds
``state.json`` and the local logs. The file is rewritten atomically after every
process start, so an interrupted ``up`` still leaves enough to stop what it
started.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from disagg.errors import StateError

STATE_FILE = "state.json"


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
    create_time: float = 0.0        # local processes: guards against pid reuse
    ssh: list[str] | None = None    # ssh argv prefix for remote processes


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

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> RunState:
        data = json.loads(text)
        procs = [ProcessRecord(**p) for p in data.pop("processes", [])]
        return cls(**data, processes=procs)


def run_path(run_dir: str | Path, name: str) -> Path:
    """The directory holding one topology's state and logs."""
    return Path(run_dir) / "runs" / name


def save_state(state: RunState) -> Path:
    """Write the state file atomically; returns its path."""
    directory = run_path(state.run_dir, state.name)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / STATE_FILE
    tmp = target.with_suffix(".tmp")
    tmp.write_text(state.to_json(), encoding="utf-8")
    os.replace(tmp, target)
    return target


def load_state(path: str | Path) -> RunState:
    """Read a state file; StateError when missing or corrupt."""
    try:
        return RunState.from_json(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise StateError(f"no run state at {path}: nothing was started with this topology "
                         "(or it was already stopped)") from exc
    except (OSError, ValueError, TypeError) as exc:
        raise StateError(f"run state {path} is unreadable: {exc}") from exc


def remove_state(state: RunState) -> None:
    """Delete the state file (logs stay for inspection)."""
    (run_path(state.run_dir, state.name) / STATE_FILE).unlink(missing_ok=True)


def find_states(run_dir: str | Path) -> list[Path]:
    """Every state file under ``run_dir``."""
    return sorted((Path(run_dir) / "runs").glob(f"*/{STATE_FILE}"))
