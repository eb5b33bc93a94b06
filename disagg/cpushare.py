"""A CPU quota shared by a group of processes: a cgroup of the ``cpu`` controller.

A host with ``emulate: {cpu_share: 0.5}`` runs its engines in one cgroup whose
quota is half a core: ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us`` on cgroup
v1 (these machines), ``cpu.max`` on v2. The quota slows every process of the
engine alike (API server, engine core, workers), so it emulates a uniformly
slower host, not one that prefills slowly and decodes well (that is the
``prefill_rate`` plugin's job).

Who calls what: the launcher calls :meth:`CpuShare.create` before it starts a
host's engines and :meth:`CpuShare.add` with each engine's pid right after the
spawn (before the engine starts its own processes, which then inherit the
cgroup); ``disagg down`` (another process, from the run's state file) calls
:func:`remove` once every process has stopped. ``root`` is a parameter so tests
can run against a fake tree.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from disagg.errors import LaunchError

CGROUP_ROOT = Path("/sys/fs/cgroup")
#: the quota's period (the kernel's default, 100 ms)
PERIOD_US = 100_000


@dataclass(frozen=True)
class CpuHierarchy:
    """Where the ``cpu`` controller is mounted and which cgroup version it is."""

    path: Path
    version: int


def find_hierarchy(root: Path = CGROUP_ROOT) -> CpuHierarchy:
    """The ``cpu`` controller's hierarchy under ``root``; LaunchError when there is none."""
    for name in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        if (root / name / "cpu.cfs_quota_us").exists():
            return CpuHierarchy(root / name, 1)
    controllers = root / "cgroup.controllers"
    if controllers.exists() and "cpu" in controllers.read_text().split():
        return CpuHierarchy(root, 2)
    raise LaunchError(f"emulate.cpu_share: no cgroup cpu controller under {root} (neither v1 cpu.cfs_quota_us "
                      "nor v2 cgroup.controllers listing cpu); remove cpu_share or run where cgroups are mounted")


def quota_text(cores: float, version: int) -> dict[str, str]:
    """The files and values that set a quota of ``cores`` CPUs."""
    quota = max(1000, round(cores * PERIOD_US))     # the kernel refuses quotas under 1 ms
    if version == 1:
        return {"cpu.cfs_period_us": str(PERIOD_US), "cpu.cfs_quota_us": str(quota)}
    return {"cpu.max": f"{quota} {PERIOD_US}"}


@dataclass(frozen=True)
class CpuShare:
    """One cgroup named ``name`` with a quota of ``cores`` CPUs."""

    name: str
    cores: float
    root: Path = CGROUP_ROOT

    def path(self) -> Path:
        return find_hierarchy(self.root).path / self.name

    def create(self) -> Path:
        """Make the cgroup (or reuse one left by a killed run) and set its quota; returns its path."""
        hierarchy = find_hierarchy(self.root)
        path = hierarchy.path / self.name
        try:
            if hierarchy.version == 2:
                _enable_cpu_controller(hierarchy.path)
            path.mkdir(exist_ok=True)
            for file, value in quota_text(self.cores, hierarchy.version).items():
                (path / file).write_text(value)
        except OSError as exc:
            raise LaunchError(f"emulate.cpu_share: cannot set a CPU quota in {path}: {exc.strerror or exc} "
                              "(it needs write access to the cgroup tree: run as root, or remove cpu_share)") from exc
        return path

    def add(self, pid: int) -> None:
        """Move ``pid`` (and whatever it already started) into the cgroup."""
        import psutil
        procs = self.path() / "cgroup.procs"
        try:
            children = [c.pid for c in psutil.Process(pid).children(recursive=True)]
        except psutil.Error:
            children = []
        try:
            for member in (pid, *children):
                procs.write_text(str(member))
        except ProcessLookupError:
            return   # it exited already: the launcher reports that
        except OSError as exc:
            raise LaunchError(f"emulate.cpu_share: cannot move pid {pid} into {procs}: {exc.strerror or exc}") from exc


def _enable_cpu_controller(parent: Path) -> None:
    """cgroup v2 hands a controller to children only when the parent's subtree_control lists it."""
    control = parent / "cgroup.subtree_control"
    if "cpu" not in control.read_text().split():
        control.write_text("+cpu")


def remove(path: str | Path) -> bool:
    """Remove the cgroup at ``path`` once its processes are gone; False when it is still in use.

    Processes still listed (a leftover that survived ``down``) are moved to the parent first, so the
    directory can go; a cgroup already gone counts as removed."""
    path = Path(path)
    if not path.exists():
        return True
    procs = path / "cgroup.procs"
    parent_procs = path.parent / "cgroup.procs"
    try:
        for line in procs.read_text().split():
            try:
                parent_procs.write_text(line)
            except ProcessLookupError:
                pass
        os.rmdir(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True
