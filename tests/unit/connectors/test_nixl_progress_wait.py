"""The vLLM general plugin that makes NIXL's progress thread wait for UCX events instead of spinning."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from disagg_connectors.nixl_progress_wait import CPU_WAIT_US, ENV, wait_in_agents, wait_us

CONNECTORS = Path(__file__).resolve().parents[3] / "connectors"

#: what starts the probe's result line (UCX prints its own warnings to the same stdout)
RESULT = "probe result: "
#: two real NIXL agents in a fresh process (argv[1]: "wait" applies :func:`wait_in_agents` first),
#: over UCX TCP on loopback: each new thread's CPU seconds and voluntary context switches over one
#: idle second, then a READ of 4 MiB in 64 descriptors checked byte for byte
PROBE = f"RESULT = {RESULT!r}\n" + """
import json, os, sys, time
os.environ["UCX_TLS"] = "tcp,self"
os.environ["UCX_NET_DEVICES"] = "lo"     # loopback only: other tests add and remove interfaces meanwhile
import numpy as np
from nixl._api import nixl_agent, nixl_agent_config
from nixl_progress_wait import wait_in_agents

def threads():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
            status = open(f"/proc/self/task/{tid}/status").read()
        except OSError:
            continue
        switches = int(status.split("voluntary_ctxt_switches:")[1].split()[0])
        out[tid] = ((int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK"), switches)
    return out

if sys.argv[1] == "wait":
    assert wait_in_agents(sys.modules[nixl_agent.__module__], 1000)
    assert not wait_in_agents(sys.modules[nixl_agent.__module__], 1000)   # once per process
mine = set(threads())
src = np.random.default_rng(0).integers(0, 255, 4 << 20, dtype=np.uint8)
dst = np.zeros_like(src)
target = nixl_agent("target", nixl_agent_config(num_threads=1))
initiator = nixl_agent("initiator", nixl_agent_config(num_threads=1))
target.register_memory(target.get_reg_descs([(src.ctypes.data, src.nbytes, 0, "")], "DRAM"))
initiator.register_memory(initiator.get_reg_descs([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM"))
initiator.add_remote_agent(target.get_agent_metadata())
time.sleep(0.5)
before = threads()
time.sleep(1.0)
after = threads()
new = {t: (after[t][0] - before[t][0], after[t][1] - before[t][1]) for t in after if t in before and t not in mine}
n, c = 64, src.nbytes // 64
local = initiator.get_xfer_descs([(dst.ctypes.data + i * c, c, 0) for i in range(n)], "DRAM")
remote = initiator.get_xfer_descs([(src.ctypes.data + i * c, c, 0) for i in range(n)], "DRAM")
handle = initiator.initialize_xfer("READ", local, remote, "target", b"done")
state = initiator.transfer(handle)
# a bound, not a speed: in full test runs on 2 cores the READ was twice still going at 30 s
deadline = time.monotonic() + 90
while state not in ("DONE", "ERR") and time.monotonic() < deadline:
    time.sleep(0.001)
    state = initiator.check_xfer_state(handle)
print(RESULT + json.dumps({"threads": new, "state": state, "equal": bool(np.array_equal(src, dst))}), flush=True)
"""


def _probe(mode: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(CONNECTORS)}
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, env=env,
                          timeout=240, check=True)
    return _result(done.stdout)


def _result(stdout: str) -> Any:
    """A probe's result line (UCX may print its own warnings to the same stdout, e.g. "ptr hash ...
    contains 64 elements on destroy" as the agents go)."""
    (line,) = [line for line in stdout.splitlines() if line.startswith(RESULT)]
    return json.loads(line.removeprefix(RESULT))


def test_wait_us_takes_positive_microseconds_only(caplog: pytest.LogCaptureFixture) -> None:
    assert wait_us(CPU_WAIT_US) == 1000
    assert wait_us(None) is None and wait_us("") is None
    assert wait_us("1000000") == 1_000_000
    for bad in ("0", "-5", "1ms", "1.5", "1000001", str(1 << 64)):
        assert wait_us(bad) is None
    assert "is not a number of microseconds from 1 to 1000000" in caplog.text


def test_every_agent_config_gets_the_delay_once_wrapped() -> None:
    """A stand-in for NIXL's ``_api`` module (its ``nixlBind.nixlAgent`` records the configs it is
    given): wrapped once, every agent built through it carries the delay, and a second wrap is refused."""
    built: list[tuple[str, Any]] = []

    def nixl_agent(name: str, config: Any) -> str:
        built.append((name, config))
        return name

    api = ModuleType("fake_nixl_api")
    api.nixlBind = SimpleNamespace(nixlAgent=nixl_agent)  # type: ignore[attr-defined]
    assert wait_in_agents(api, 1000)
    assert not wait_in_agents(api, 5)
    config = SimpleNamespace(pthrDelay=0)
    assert api.nixlBind.nixlAgent("a", config) == "a"  # type: ignore[attr-defined]
    assert built == [("a", config)] and config.pthrDelay == 1000


def test_a_nixl_without_the_constructor_is_left_alone_and_said(caplog: pytest.LogCaptureFixture) -> None:
    assert not wait_in_agents(ModuleType("no_bindings"), 1000)
    assert "no_bindings has no nixlBind.nixlAgent" in caplog.text


def test_registered_as_a_vllm_general_plugin() -> None:
    names = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert names.get("disagg_nixl_progress_wait") == "disagg_connectors.nixl_progress_wait:register"


def test_real_nixl_progress_thread_spins_as_built_and_waits_with_the_delay() -> None:
    """Two real NIXL agents (UCX over TCP on loopback). As NIXL's Python API builds them, one of
    their threads spins: CPU time with next to no voluntary context switch (it never sleeps). With
    the delay one of them sleeps hundreds of times a second (its 1 ms polls), none takes more than
    a few percent of a core while idle, and a READ still moves every byte."""
    spinning, waiting = _probe("spin"), _probe("wait")
    for seen in (spinning, waiting):
        assert seen["state"] == "DONE" and seen["equal"], seen
    assert any(cpu >= 0.05 and switches <= 20 for cpu, switches in spinning["threads"].values()), spinning
    assert any(switches >= 200 for _, switches in waiting["threads"].values()), waiting
    assert all(cpu <= 0.15 for cpu, _ in waiting["threads"].values()), waiting


#: through vLLM's own loader, as its NIXL connectors reach NIXL (argv[1] "before": vLLM loads NIXL's
#: agent class before the plugin registers): the config the bindings' agent constructor is given
#: when vLLM's ``NixlWrapper`` builds an agent (a recorder in that constructor's place)
LOADER_PROBE = f"RESULT = {RESULT!r}\n" + """
import json, sys
import nixl._api as api
from nixl_progress_wait import register

class Built(Exception):
    pass

seen = {}

def recorder(name, config):
    seen["pthrDelay"] = config.pthrDelay
    raise Built

api.nixlBind.nixlAgent = recorder
if sys.argv[1] == "before":
    from vllm.distributed.nixl_utils import NixlWrapper
register()
from vllm.distributed.nixl_utils import NixlWrapper, nixl_agent_config
assert sys.modules[NixlWrapper.__module__] is api
try:
    NixlWrapper("probe", nixl_agent_config(num_threads=1))
except Built:
    pass
print(RESULT + json.dumps(seen), flush=True)
"""


@pytest.mark.engine
@pytest.mark.parametrize(("value", "order", "delay"),
                         [(CPU_WAIT_US, "after", 1000), (CPU_WAIT_US, "before", 1000), (None, "after", 0)])
def test_agents_vllm_builds_get_the_delay_only_when_enabled(value: str | None, order: str, delay: int) -> None:
    """Through vLLM's own loader, whether NIXL's agent class was loaded before the plugin registered
    or after: with the variable every agent vLLM builds has the delay; without it NIXL's own 0."""
    env = {k: v for k, v in os.environ.items() if k != ENV}
    env["PYTHONPATH"] = str(CONNECTORS)
    if value is not None:
        env[ENV] = value
    done = subprocess.run([sys.executable, "-c", LOADER_PROBE, order], capture_output=True, text=True, env=env,
                          timeout=300, check=True)
    assert _result(done.stdout) == {"pthrDelay": delay}
