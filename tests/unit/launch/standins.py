"""Stand-ins for engines: plain Python process trees shaped like a vLLM API server's.

A real API server runs in a session of its own (``disagg up`` starts it with
``start_new_session``) and spawns ``EngineCore`` and worker processes into its
process group; SIGKILLing the API server leaves them running. The stand-in
leader below does the same with sleepers, which is what process-group handling
is about, and it can be made to do it on demand (a real engine takes a minute).
"""

from __future__ import annotations

import sys
import textwrap
import time
from pathlib import Path

import psutil

from disagg.launch import processes
from disagg.launch.state import ProcessRecord
from disagg.topology import Topology, load_topology
from harness.engines import process_trees

#: the stand-in "API server": three children like EngineCore and workers, one ignoring SIGTERM,
#: one moved to a process group of its own (still in the session), one grandchild
ENGINE_TREE = r"""
import os, signal, subprocess, sys, time
sleep = [sys.executable, '-c', 'import time; time.sleep(600)']
stubborn = [sys.executable, '-c', 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); '
            'print("ignoring", flush=True); time.sleep(600)']
nested = [sys.executable, '-c', 'import subprocess, sys, time; subprocess.Popen(sys.argv[1:]); time.sleep(600)', *sleep]
kids = [subprocess.Popen(sleep), subprocess.Popen(stubborn, stdout=subprocess.PIPE),
        subprocess.Popen(sleep, process_group=0), subprocess.Popen(nested)]
kids[1].stdout.readline()   # 'tree up' only once the stubborn child ignores SIGTERM
print('tree up', *[k.pid for k in kids], flush=True)
time.sleep(600)
"""
#: processes of one stand-in tree: the leader, 4 children, 1 grandchild
TREE_SIZE = 6


def start_tree(tmp_path: Path, name: str = "decode[0]") -> tuple[ProcessRecord, list[psutil.Process]]:
    """Start a stand-in engine the way the launcher starts engines; its record and all 6 processes."""
    log = tmp_path / f"{name.replace('[', '-').replace(']', '')}.log"
    pid, created = processes.start_local([sys.executable, "-c", ENGINE_TREE], {}, log)
    rec = ProcessRecord(name=name, kind="proxy" if name == "proxy" else "engine", host="local",
                        address="127.0.0.1", port=1, url="http://127.0.0.1:1", log=str(log), pid=pid,
                        create_time=created)
    deadline = time.monotonic() + 60
    while True:
        tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        if len(tree) == TREE_SIZE and "tree up" in (log.read_text() if log.exists() else ""):
            return rec, tree
        assert time.monotonic() < deadline, f"the stand-in tree did not come up: {log.read_text()}"
        time.sleep(0.05)


class Started:
    """Every stand-in process tree a test started in place of an engine or the proxy (its pids),
    for the final check and the cleanup."""

    def __init__(self) -> None:
        self.pids: list[int] = []
        self.logs: list[Path] = []
        #: names of the logs (``decode-0.log``) whose next start is stuck: it prints a stuck-start
        #: line (``EngineAdapter.stuck_start_lines``) and never serves
        self.stuck: set[str] = set()

    def up(self, count: int) -> bool:
        """At least ``count`` trees started, each whole and saying ``tree up`` in its log (so its
        stubborn child already ignores SIGTERM)."""
        return len(self.pids) >= count and all(log.exists() and "tree up" in log.read_text() for log in self.logs) \
            and len(running(self.processes())) >= count * TREE_SIZE

    def processes(self) -> list[psutil.Process]:
        """Each started root with its descendants, while they exist."""
        return process_trees(self.pids)


def running(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Those of ``procs`` still running (zombies count as gone)."""
    out = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except psutil.Error:
            continue
    return out


def kill_all(procs: list[psutil.Process]) -> None:
    """Cleanup for a failed test: SIGKILL whatever is left."""
    for proc in running(procs):
        try:
            proc.kill()
        except psutil.Error:
            pass
    for proc in procs:
        processes.exit_status(proc.pid)


def remote_lmcache_topology(tmp_path: Path, extra: str = "") -> Topology:
    """An LMCache 1P1D whose prefill host ``p`` is reached over ssh (``me@p``, workdir under
    ``tmp_path``; a test stands in for ssh) and whose decode host and proxy are not this
    machine's addresses; ``extra``: more topology lines. Written to ``tmp_path/lm.yaml``."""
    path = tmp_path / "lm.yaml"
    path.write_text(textwrap.dedent(f"""\
        model: {{path: /models/m}}
        engine: vllm
        connector: lmcache
        link: {{type: ethernet}}
        proxy: {{host: 10.0.0.9}}
        hosts:
          p: {{address: 10.0.0.1, ssh: me@p, workdir: {tmp_path}/remote}}
          d: {{address: 10.0.0.2}}
        roles:
          prefill: [{{host: p, port: 8100}}]
          decode: [{{host: d, port: 8200, kv_port: 7300}}]
        """) + extra)
    return load_topology(path, run_dir=str(tmp_path / "run"))
