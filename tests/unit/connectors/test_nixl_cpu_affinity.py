"""The vLLM general plugin that keeps NIXL's KV-transfer core inside the engine's own cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
from disagg_connectors.nixl_cpu_affinity import ENV, own_cores_only

#: one vLLM process (one import of vLLM, ~8 s of CPU), a worker thread bound to core 0 as vLLM's
#: OMP setup does: vLLM's own NUMA topology; the same after the general plugins load as in every
#: vLLM worker at start, without the variable; then with it, the plugin's ``register`` (what that
#: load calls) run again
PROBE = (
    "import json, os\n"
    "os.sched_setaffinity(0, {0})\n"
    "from vllm.platforms.cpu import CpuPlatform\n"
    "found = {'vllm': CpuPlatform.discover_numa_topology()}\n"
    "from vllm.plugins import load_general_plugins\n"
    "load_general_plugins()\n"
    "found['unset'] = CpuPlatform.discover_numa_topology()\n"
    "from disagg_connectors.nixl_cpu_affinity import ENABLED, ENV, register\n"
    "os.environ[ENV] = ENABLED\n"
    "register()\n"
    "found['enabled'] = CpuPlatform.discover_numa_topology()\n"
    "print(json.dumps(found))\n"
)


def test_intersection_by_hand() -> None:
    assert own_cores_only([[0, 1, 2, 3], [4, 5, 6, 7]], {1, 2}) == [[1, 2]]
    assert own_cores_only([[0, 1], [2, 3]], {1, 3}) == [[1], [3]]
    assert own_cores_only([[0, 1]], {5}) == []  # nothing reserved: vLLM then leaves the thread alone


def test_registered_as_a_vllm_general_plugin() -> None:
    names = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert names.get("disagg_nixl_cpu_affinity") == "disagg_connectors.nixl_cpu_affinity:register"


@pytest.mark.engine
def test_vllm_reserves_only_the_threads_own_cores_when_enabled_and_its_own_answer_without() -> None:
    """Through vLLM's own plugin loader and CPU platform: loaded but not enabled, the plugin leaves
    vLLM's answer (every core of the node) as it is; enabled, [[0]] for a thread on core 0."""
    env = {k: v for k, v in os.environ.items() if k != ENV}
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300,
                          check=True)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["unset"] == found["vllm"], found
    assert found["enabled"] == [[0]], found
