"""Where a topology's run lives on each host (a fact of the topology; no I/O).

``<run_dir>/runs/<name>`` on this machine (absolute), ``<workdir>/runs/<name>``
on a remote host (relative paths start at the SSH login's home).
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from disagg.topology import DEFAULT_RUN_DIR, HostSpec, Topology

#: the sub-directory of a run directory that holds the logs
LOGS = "logs"
#: the builtin proxy's log in a run's log directory (``up`` starts it afresh each time)
PROXY_LOG = "proxy.log"


def run_path(run_dir: str | Path, name: str) -> Path:
    """The directory of one topology's run on this machine: ``<run_dir>/runs/<name>`` (state, lock, logs)."""
    return Path(run_dir) / "runs" / name


def host_run_dir(topo: Topology, host: HostSpec) -> str:
    """The topology's run directory on ``host``: ``<run_dir>/runs/<name>`` here (absolute),
    ``<workdir>/runs/<name>`` on a remote host (relative paths start at the SSH login's home)."""
    if host.is_remote:
        return str(PurePosixPath(host.workdir or DEFAULT_RUN_DIR) / "runs" / topo.name)
    return str(run_path(Path(topo.run_dir).resolve(), topo.name))


def host_log(topo: Topology, host: HostSpec, log_name: str) -> str:
    """Where a process of the topology on ``host`` writes its log."""
    return str(PurePosixPath(host_run_dir(topo, host)) / LOGS / log_name)
