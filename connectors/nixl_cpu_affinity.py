"""vLLM general plugin: keep the NIXL connector's KV-transfer core inside the engine's own cores.

On the CPU backend, vLLM's ``NixlConnectorWorker.__init__``
(``kv_connector/v1/nixl/base_worker.py``) "reserves" the highest core of every
NUMA node for KV transfer and moves the worker's main thread there with
``os.sched_setaffinity(0, ...)``, whatever ``VLLM_CPU_OMP_THREADS_BIND`` said.
With ``OMP_NUM_THREADS=1`` that main thread *is* the compute thread, so an
engine pinned to core 0 computes on the machine's last core, next to whatever
runs there (on a 2-core box: the decode engine), while core 0 keeps only its
NIXL progress thread. Measured on this project's machine: the prefill engine
of a CPU 1P1D ran several times slower than its core count explains
(docs/results.md).

Upstream vLLM has the fix under review (vllm-project/vllm#58036, for #58033:
intersect each NUMA node's cores with ``os.sched_getaffinity(0)``). This
plugin applies the same rule to the installed vLLM through its plugin hook
(entry point ``vllm.general_plugins``), without patching vLLM's files, and
only in processes whose environment has ``DISAGG_NIXL_CPU_AFFINITY=own-cores``
(``disagg up`` sets it for CPU engines that use NIXL). When the worker's
thread is already bound to its own cores, the "reserved" core is then one of
them. Harmless where vLLM already intersects (the result is the same).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable

ENV = "DISAGG_NIXL_CPU_AFFINITY"
ENABLED = "own-cores"


def own_cores_only(numa_nodes: list[list[int]], allowed: set[int]) -> list[list[int]]:
    """Each NUMA node's cores intersected with ``allowed``; nodes left empty are dropped."""
    return [kept for node in numa_nodes if (kept := [cpu for cpu in node if cpu in allowed])]


def _wrap(discover: Callable[[], list[list[int]]]) -> Callable[[type], list[list[int]]]:
    def discover_own_numa_topology(cls: type) -> list[list[int]]:
        allowed = os.sched_getaffinity(0)
        nodes = discover()
        kept = own_cores_only(nodes, allowed)
        logging.getLogger("vllm").info("disagg: NIXL KV-transfer cores limited to this thread's cores %s: %s -> %s",
                                       sorted(allowed), nodes, kept)
        return kept

    # only __wrapped__ (register() looks for it), not discover's name or docstring
    return functools.update_wrapper(discover_own_numa_topology, discover, assigned=(), updated=())


def register() -> None:
    """vLLM calls this in every process it starts; active only with ``DISAGG_NIXL_CPU_AFFINITY=own-cores``."""
    if os.environ.get(ENV) != ENABLED:
        return
    try:
        from vllm.platforms.cpu import CpuPlatform
    except ImportError:  # not a vLLM build with the CPU platform
        return
    current = CpuPlatform.discover_numa_topology
    if hasattr(current, "__wrapped__"):  # registered already in this process
        return
    CpuPlatform.discover_numa_topology = classmethod(_wrap(current))
