"""The vLLM general plugin that cuts an engine queue reader's busy-wait short (connectors/engine_spin.py):
registered, inert without its variable, the wait's phases (vLLM's spin, short sleeps, short polls
of the socket, vLLM's sleep on the socket), in a real vLLM process a reader past its spin that neither
spins nor misses a message whose notification the writer dropped, and turned on by the instances
that ask for it (the emulated house's), not by ``disagg up``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from importlib.metadata import entry_points
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from disagg_connectors import engine_spin
from disagg_connectors.engine_spin import CPU_SPIN_S, ENV, POLL_MS, SLEEP_MIN_S, SOCKET_AFTER_S, parse_spin, polling

NOBLOCK = 1


class Socket:
    """A notify socket: hashable (the poller's answer is a dict by socket), records what was taken."""

    def __init__(self) -> None:
        self.taken: list[int] = []

    def recv(self, flags: int, copy: bool) -> None:
        self.taken.append(flags)


class Reader(SimpleNamespace):
    """A queue reader as ``SpinCondition.wait`` sees it: its last read, vLLM's spin, a poller and
    the notify socket (the poll answers ``notified``; what was polled and taken is recorded)."""

    def __init__(self, since_read_s: float, notified: bool = False) -> None:
        socket = Socket()
        polls: list[int | None] = []

        def poll(timeout: int | None = None) -> list[tuple[Any, int]]:
            polls.append(timeout)
            return [(socket, 1)] if notified else []

        super().__init__(is_reader=True, last_read=time.monotonic() - since_read_s, busy_loop_s=1.0,
                         local_notify_socket=socket, poller=SimpleNamespace(poll=poll), polls=polls)


def _vllms_wait() -> tuple[Any, list[tuple[Any, int | None]]]:
    calls: list[tuple[Any, int | None]] = []
    return (lambda self, timeout_ms=None: calls.append((self, timeout_ms))), calls


def test_registered_as_a_vllm_general_plugin() -> None:
    names = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert names.get("disagg_engine_spin") == "disagg_connectors.engine_spin:register"


def test_inside_its_spin_and_past_vllms_a_reader_waits_as_vllm_s_own() -> None:
    vllm_wait, calls = _vllms_wait()
    wait = polling(vllm_wait, 0.002, NOBLOCK)
    spinning, idle = Reader(0.0005), Reader(1.5)
    wait(spinning, 5000)
    wait(idle, 5000)
    writer = SimpleNamespace(is_reader=False)
    wait(writer)
    assert calls == [(spinning, 5000), (idle, 5000), (writer, None)]
    assert spinning.polls == idle.polls == []


def test_soon_after_its_spin_a_reader_sleeps_a_share_of_the_time_since_its_message(
        monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(engine_spin.time, "sleep", slept.append)
    vllm_wait, calls = _vllms_wait()
    wait = polling(vllm_wait, 0.001, NOBLOCK)
    just, later = Reader(0.0015), Reader(0.9 * SOCKET_AFTER_S)     # 5% of 1.5 ms is below the least sleep
    wait(just, 5000)
    wait(later, 5000)
    assert calls == [] and just.polls == later.polls == []
    assert slept[0] == SLEEP_MIN_S and slept[1] == pytest.approx(0.05 * 0.9 * SOCKET_AFTER_S, rel=0.05)


def test_then_until_vllms_spin_ends_it_polls_its_socket_briefly_and_takes_the_notification() -> None:
    vllm_wait, calls = _vllms_wait()
    wait = polling(vllm_wait, 0.002, NOBLOCK)
    quiet, notified, hurried = Reader(0.1), Reader(0.5, notified=True), Reader(0.1)
    wait(quiet, 5000)
    wait(notified)
    wait(hurried, 0)
    assert calls == []
    assert (quiet.polls, notified.polls, hurried.polls) == ([POLL_MS], [POLL_MS], [0])
    assert quiet.local_notify_socket.taken == [] and notified.local_notify_socket.taken == [NOBLOCK]


@pytest.mark.parametrize("text", ["-1", "nan", "inf", "soon"])
def test_a_bad_value_is_refused_by_name(text: str) -> None:
    with pytest.raises(ValueError, match=ENV if text != "soon" else "could not convert"):
        parse_spin(text)
    assert parse_spin(CPU_SPIN_S) == 0.002 and parse_spin("0") == 0.0


def test_disagg_up_leaves_vllms_spin_unless_the_instance_asks_and_the_emulated_house_does(tmp_path: Path) -> None:
    from disagg.engines.vllm import VllmEngine
    from disagg.topology import load_topology

    for name, expected in (("local-cpu.yaml", None), ("house-emulated.yaml", CPU_SPIN_S)):
        file = tmp_path / name
        file.write_text((Path("topologies") / name).read_text())
        topo = load_topology(file)
        for inst in topo.instances:
            env = {**VllmEngine().env(topo, inst, topo.hosts[inst.host]), **dict(inst.env)}
            assert env.get(ENV) == expected, (name, inst.name)


#: one vLLM process: the plugins load as in every vLLM process at start (with the variable); a real
#: SpinCondition writer and reader; the reader read its last message 0.1 s ago (past the plugin's
#: spin, inside vLLM's). It waits 0.3 s for nothing (its CPU time against the wall's), then the
#: writer drops notifications (sent faster than the reader takes them) and the reader, waiting
#: as the queue does until a message shows, sees the last message within a few polls
PROBE = """\
import json, os, tempfile, time
os.environ[{env!r}] = '0.002'
from vllm.plugins import load_general_plugins
load_general_plugins()
import zmq
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
ctx = zmq.Context()
address = f"ipc://{{tempfile.mkdtemp()}}/notify"
writer, reader = SpinCondition(False, ctx, address), SpinCondition(True, ctx, address)
time.sleep(0.2)
reader.last_read = time.monotonic() - 0.1
wall, cpu = time.monotonic(), time.process_time()
while time.monotonic() - wall < 0.3:
    reader.wait(timeout_ms=5000)
wall, cpu = time.monotonic() - wall, time.process_time() - cpu
late = []
for _ in range(50):
    reader.last_read = time.monotonic() - 0.1
    for _ in range(3):
        writer.notify()
    written = time.monotonic()
    reader.wait(timeout_ms=5000)        # a wake-up for the first notification, or a short poll
    while time.monotonic() - written < 0.002:
        reader.wait(timeout_ms=5000)    # the queue's loop: wait until the message shows (2 ms here)
    late.append(time.monotonic() - written)
print(json.dumps({{"wrapped": hasattr(SpinCondition.wait, "__wrapped__"), "wall": wall, "cpu": cpu,
                  "late_max": max(late)}}))
"""


@pytest.mark.engine
def test_in_a_vllm_process_a_reader_past_its_spin_neither_spins_nor_sleeps_through_a_message() -> None:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    done = subprocess.run([sys.executable, "-c", PROBE.format(env=ENV)], capture_output=True, text=True, env=env,
                          timeout=300, check=True)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["wrapped"]
    # vLLM's own spin takes the whole wall time in CPU; short polls a few percent of it
    assert found["cpu"] < 0.3 * found["wall"], found
    # vLLM's sleep on the socket would wait 5 s for a dropped notification; a poll, milliseconds
    assert found["late_max"] < 0.5, found
