"""The engine adapter interface: how one engine family is started for a role.

An adapter turns (topology, instance) into the exact argv and environment of
one stock engine process. ``disagg.deployment.build_deployment`` calls
``argv``/``env`` once per instance while building the plan that ``check``
prints and ``up`` runs; adapters are pure (no I/O, no process start) so the
plan can be printed, tested and sent over SSH unchanged.

It also says what its engines can do with the topology's connector (the vLLM
adapter asks that connector's :class:`disagg.kv.base.VllmKVAdapter`): the
proxy's handoff and its options (``disagg.launch.frontend``), whether a decode
engine can compute a prompt itself and a prefill engine serve one alone (the
proxy's routing), the per-run secrets (``disagg.launch.launcher``) and the
connector's settings (``disagg check``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from disagg.topology import HostSpec, InstanceSpec, Topology


class EngineAdapter(ABC):
    """One engine family (vLLM, SGLang)."""

    #: name used in the topology's ``engine:`` field
    name: str
    #: path polled until it answers 200 when the engine is ready
    health_path: str = "/health"
    #: log lines (substrings) after which a starting engine never becomes ready though its
    #: process lives on; the launcher stops waiting at the first one and reports it
    stuck_start_lines: tuple[str, ...] = ()
    #: a decode engine can compute a prompt itself (the routing paths ``local`` and ``auto``)
    decode_prefills: bool = True
    #: flags of ``argv`` that an instance's ``args`` may give again, adding to ours (an append
    #: action); every other flag ``argv`` sets is refused in ``args`` (``disagg.deployment``)
    additive_flags: tuple[str, ...] = ()

    @abstractmethod
    def argv(self, topo: Topology, inst: InstanceSpec, host: HostSpec, python: str) -> list[str]:
        """The full command line, starting with ``python``. Called once per instance."""

    @abstractmethod
    def env(self, topo: Topology, inst: InstanceSpec, host: HostSpec) -> dict[str, str]:
        """Environment variables to set on top of the inherited environment."""

    def key_env(self, topo: Topology) -> str | None:
        """The environment variable that carries the run's engine key into this engine, which then
        answers only requests bearing it; None (the default) when the engine cannot be guarded.
        The launcher generates the key and sets the variable (never on a command line)."""
        return None

    def files(self, topo: Topology, inst: InstanceSpec, host: HostSpec) -> dict[str, str]:
        """Config files written into the run directory on the instance's host before it
        starts: file name -> contents (default none)."""
        return {}

    def handoff(self, topo: Topology) -> str:
        """The proxy's handoff (``--handoff``) between this disaggregated topology's engines
        (default: the engine's name)."""
        return self.name

    def handoff_options(self, topo: Topology) -> tuple[tuple[str, str], ...]:
        """The proxy's ``--handoff-option`` settings for this disaggregated topology (default none)."""
        return ()

    def serves_whole(self, topo: Topology) -> bool:
        """Whether a prefill engine of this disaggregated topology serves a plain request alone
        (the routing path ``whole``; default no)."""
        return False

    def run_env(self, topo: Topology) -> dict[str, str]:
        """Secrets drawn fresh for one run of this disaggregated topology, for every engine's
        environment (never argv or the plan; default none)."""
        return {}

    def connector_settings(self, topo: Topology) -> str:
        """The connector's own settings for ``disagg check``'s mode line (default none)."""
        return ""


def cpu_list(cpus: tuple[int, ...]) -> str:
    """``(0, 1, 2, 5)`` -> ``"0-2,5"`` (the form VLLM_CPU_OMP_THREADS_BIND and taskset take)."""
    parts: list[str] = []
    start = prev = None
    for cpu in sorted(set(cpus)):
        if prev is not None and cpu == prev + 1:
            prev = cpu
            continue
        if start is not None:
            parts.append(f"{start}-{prev}" if prev != start else f"{start}")
        start = prev = cpu
    if start is not None:
        parts.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ",".join(parts)
