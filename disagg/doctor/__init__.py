"""``disagg doctor`` and ``disagg setup``: is every host of a topology ready to serve, and making it so.

- :mod:`disagg.doctor.plan`: who is checked and what each host's agent is asked (pure)
- :mod:`disagg.doctor.agents`: the agents (:mod:`disagg._doctor_agent`) run on every host at once
- :mod:`disagg.doctor.checks`: their reports -> rows (ok / FAIL / warn / skip)
- :mod:`disagg.doctor.table`: the rows as a table
- :mod:`disagg.doctor.setup`: ``disagg setup``: the venv and the model copied to remote hosts

:func:`run_doctor` is the whole check (``disagg doctor``); :func:`preflight` is the part that needs
no listener, no other host and no clock, which ``disagg up`` runs before it starts anything.
"""

from __future__ import annotations

from disagg.deployment import Deployment
from disagg.doctor.agents import run_agents
from disagg.doctor.checks import FAIL, Row, rows
from disagg.doctor.plan import participants, reach_pairs
from disagg.errors import LaunchError


class PreflightError(LaunchError):
    """``up``'s first checks failed on some host; nothing was started."""


def run_doctor(dep: Deployment, *, cheap: bool = False, commands: dict[str, str] | None = None,
               timeout: float | None = None) -> list[Row]:
    """Every check on every host of ``dep``'s topology, in about the time of one ssh round trip.

    ``commands`` replaces the programs the checks run on every host (``nvidia-smi``, ``date``),
    e.g. by a stand-in where the hardware is absent. ``timeout``: for all agents together
    (default: the topology's ``timeouts.ssh_check``)."""
    topo = dep.topology
    parts = participants(dep, cheap=cheap, commands=commands)
    reach = [] if cheap else reach_pairs(dep, parts)
    runs = run_agents(parts, reach, timeout=timeout if timeout is not None else topo.timeouts.ssh_check)
    return rows(topo, runs, reach, cheap=cheap)


def preflight(dep: Deployment, *, commands: dict[str, str] | None = None) -> list[Row]:
    """``up``'s first step: the cheap checks; raises :class:`PreflightError` naming each failure."""
    found = run_doctor(dep, cheap=True, commands=commands)
    failed = [r for r in found if r.status == FAIL]
    if failed:
        raise PreflightError("preflight failed, nothing was started: "
                             + "; ".join(f"{r.check} on {r.host}: {r.detail}" for r in failed)
                             + f"; `disagg doctor {dep.topology.file}` checks everything")
    return found
