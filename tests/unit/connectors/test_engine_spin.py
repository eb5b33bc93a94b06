"""The vLLM general plugin that caps the engine worker's busy-wait (connectors/engine_spin.py):
registered, inert without its variable, capping ``busy_loop_s`` with it in a real vLLM process (a
subprocess that loads the plugins as vLLM does), and set by ``disagg up`` on CPU engines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest
from disagg_connectors.engine_spin import CPU_SPIN_S, ENV, capped, parse_spin

#: one vLLM process: the plugins load as in every vLLM process at start (with the variable), then a
#: queue reader's wait runs once past its spin; the reader's busy_loop_s is what the wait left
PROBE = (
    "import json, os\n"
    f"os.environ[{ENV!r}] = '0.002'\n"
    "from vllm.plugins import load_general_plugins\n"
    "load_general_plugins()\n"
    "from vllm.distributed.device_communicators.shm_broadcast import SpinCondition\n"
    "wait = SpinCondition.wait\n"
    "reader = SpinCondition.__new__(SpinCondition)\n"
    "reader.is_reader, reader.busy_loop_s, reader.last_read = True, 1.0, 0.0\n"
    "reader.poller = type('P', (), {'poll': lambda self, timeout=None: []})()\n"
    "reader.read_cancel_socket = reader.local_notify_socket = object()\n"
    "wait(reader, timeout_ms=0)\n"
    "print(json.dumps({'wrapped': hasattr(wait, '__wrapped__'), 'busy_loop_s': reader.busy_loop_s}))\n"
)


def test_registered_as_a_vllm_general_plugin() -> None:
    names = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert names.get("disagg_engine_spin") == "disagg_connectors.engine_spin:register"


def test_the_wait_caps_the_reader_s_spin_and_leaves_a_shorter_one() -> None:
    seen: list[float] = []
    wait = capped(lambda self, timeout_ms=None: seen.append(self.busy_loop_s), 0.002)
    long_spin, short_spin = SimpleNamespace(busy_loop_s=1.0), SimpleNamespace(busy_loop_s=0.0)
    wait(long_spin, timeout_ms=5)
    wait(short_spin)
    assert seen == [0.002, 0.0] and long_spin.busy_loop_s == 0.002


@pytest.mark.parametrize("text", ["-1", "nan", "inf", "soon"])
def test_a_bad_value_is_refused_by_name(text: str) -> None:
    with pytest.raises(ValueError, match=ENV if text != "soon" else "could not convert"):
        parse_spin(text)
    assert parse_spin(CPU_SPIN_S) == 0.002 and parse_spin("0") == 0.0


def test_disagg_up_sets_it_on_cpu_engines(tmp_path) -> None:
    from disagg.engines.vllm import VllmEngine
    from disagg.topology import load_topology

    file = tmp_path / "t.yaml"
    file.write_text(open("topologies/local-cpu.yaml").read())
    topo = load_topology(file)
    inst = topo.instances[0]
    env = VllmEngine().env(topo, inst, topo.hosts[inst.host])
    assert env[ENV] == CPU_SPIN_S


@pytest.mark.engine
def test_in_a_vllm_process_the_plugin_caps_the_queue_reader_s_spin() -> None:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300,
                          check=True)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == {"wrapped": True, "busy_loop_s": 0.002}
