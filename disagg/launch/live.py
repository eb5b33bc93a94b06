"""The per-user list of live runs, so ``disagg status`` and ``disagg down`` find a run from any
directory (a run's state lives under its ``run_dir``, ``.disagg`` of the directory ``up`` ran in
by default).

One small file per run under ``$XDG_STATE_HOME/disagg/live/`` (``~/.local/state/disagg/live/``
when the variable is unset), named after the run directory and holding its path.
``disagg.launch.state.save_state`` writes it, ``remove_state`` removes it; a reader drops the
entries whose state file is gone (a run directory deleted by hand). Writing it is best-effort:
a run whose entry could not be written is still found from its own directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path

#: the state file's name in a run directory (``disagg.launch.state.STATE_FILE``)
_STATE_FILE = "state.json"


def live_dir() -> Path:
    """Where the entries live: ``$XDG_STATE_HOME/disagg/live`` or ``~/.local/state/disagg/live``."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "disagg" / "live"


def _entry(run_path: Path) -> Path:
    digest = hashlib.sha256(str(run_path.resolve()).encode()).hexdigest()[:20]
    return live_dir() / f"{run_path.name}-{digest}"


def register(run_path: Path) -> None:
    """Record a run directory (``<run_dir>/runs/<name>``) as live; never raises."""
    entry = _entry(run_path)
    if entry.exists():
        return
    tmp = entry.with_suffix(".tmp")
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(str(run_path.resolve()) + "\n", encoding="utf-8")
        os.replace(tmp, entry)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def unregister(run_path: Path) -> None:
    """Forget a run directory (its state file was removed); never raises."""
    with contextlib.suppress(OSError):
        _entry(run_path).unlink(missing_ok=True)


def live_runs() -> list[Path]:
    """The run directories with a state file, in name order; entries without one are removed."""
    found: list[Path] = []
    try:
        entries = sorted(p for p in live_dir().iterdir() if not p.name.endswith(".tmp"))
    except OSError:
        return []
    for entry in entries:
        try:
            run = Path(entry.read_text(encoding="utf-8").strip())
        except (OSError, UnicodeDecodeError):
            continue
        if run.is_absolute() and (run / _STATE_FILE).is_file():
            found.append(run)
        else:
            with contextlib.suppress(OSError):
                entry.unlink()
    return found
