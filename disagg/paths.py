"""Where a topology's run lives on each host (a fact of the topology; no I/O).

``<run_dir>/runs/<name>`` on this machine (absolute), ``<workdir>/runs/<name>``
on a remote host (relative paths start at the SSH login's home).
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from disagg.topology import HostSpec, Topology


def host_run_dir(topo: Topology, host: HostSpec) -> str:
    """The topology's run directory on ``host``: ``<run_dir>/runs/<name>`` here (absolute),
    ``<workdir>/runs/<name>`` on a remote host (relative paths start at the SSH login's home)."""
    if host.is_remote:
        return str(PurePosixPath(host.workdir or ".disagg") / "runs" / topo.name)
    return str(Path(topo.run_dir).resolve() / "runs" / topo.name)
