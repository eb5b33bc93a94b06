"""The vLLM general plugin that keeps NIXL's KV-transfer core inside the engine's own cores."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
from disagg_connectors.nixl_cpu_affinity import ENABLED, ENV, own_cores_only

PROBE = (
    "import os\n"
    "os.sched_setaffinity(0, {0})\n"  # the worker thread, bound to core 0 as vLLM's OMP setup does
    "from vllm.plugins import load_general_plugins\n"
    "load_general_plugins()\n"  # what every vLLM worker does at start
    "from vllm.platforms.cpu import CpuPlatform\n"
    "print(CpuPlatform.discover_numa_topology())\n"
)


def test_intersection_by_hand() -> None:
    assert own_cores_only([[0, 1, 2, 3], [4, 5, 6, 7]], {1, 2}) == [[1, 2]]
    assert own_cores_only([[0, 1], [2, 3]], {1, 3}) == [[1], [3]]
    assert own_cores_only([[0, 1]], {5}) == []  # nothing reserved: vLLM then leaves the thread alone


def test_registered_as_a_vllm_general_plugin() -> None:
    names = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert names.get("disagg_nixl_cpu_affinity") == "disagg_connectors.nixl_cpu_affinity:register"


def _reserved_cores(enabled: bool, plugins: bool = True) -> str:
    """vLLM's NUMA topology as a worker bound to core 0 sees it; ``plugins`` false: without loading
    the general plugins at all (vLLM's own answer)."""
    env = {k: v for k, v in os.environ.items() if k != ENV}
    if enabled:
        env[ENV] = ENABLED
    probe = PROBE if plugins else PROBE.replace("load_general_plugins()\n", "")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300,
                          check=True)
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.engine
def test_vllm_reserves_only_the_threads_own_cores_when_enabled() -> None:
    """Through vLLM's own plugin loader and CPU platform: [[0]] for a thread on core 0."""
    assert _reserved_cores(enabled=True) == "[[0]]"


@pytest.mark.engine
def test_inert_without_the_environment_variable() -> None:
    """Loaded but not enabled, the plugin leaves vLLM's own answer (every core of the node) as it is."""
    assert _reserved_cores(enabled=False) == _reserved_cores(enabled=False, plugins=False)
