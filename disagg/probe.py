"""Measure the link between a topology's prefill and decode hosts.

The receiver (``python -m disagg._probe_agent serve``) runs on the decode
host, bound to its topology address; the sender runs on the prefill host, the
direction the KV cache travels. A host runs the agent as a local subprocess,
or over SSH (``ssh [-p port] [-i key] -o BatchMode=yes target python -m
disagg._probe_agent ...`` with the host's python from the topology, so disagg
must be installed there). For ``link: {type: emulated}`` both ends run inside
a fresh :class:`~disagg.linkemu.EmulatedLink` shaped at the topology's rate.
"""

from __future__ import annotations

import json
import os
import select
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import disagg
from disagg.emulation import emulated_link
from disagg.errors import LinkError
from disagg.measurements import LinkMeasurement, now_iso
from disagg.planning import first_pair
from disagg.ssh import ssh_prefix
from disagg.topology import HostSpec, Topology

AGENT_MODULE = "disagg._probe_agent"
READY_TIMEOUT_S = 30.0
DEFAULT_STREAMS = (1, 2, 4)
DEFAULT_SECONDS = 3.0

Wrap = Callable[[list[str]], list[str]]


def ssh_argv(host: HostSpec, remote_argv: Sequence[str], options: Sequence[str] = ()) -> list[str]:
    """The ssh command line that ``disagg up`` uses for ``host`` (:func:`disagg.ssh.ssh_prefix`:
    the host's ``ssh_options`` included), running ``remote_argv`` there.

    ``options`` are further ssh arguments placed before the target (e.g. ``-o UserKnownHostsFile=...``).
    """
    prefix = ssh_prefix(host)
    return [*prefix[:-1], *options, prefix[-1], shlex.join(remote_argv)]


@dataclass(frozen=True)
class AgentSide:
    """How to start the probe agent on one end, and the address it uses there."""

    host: HostSpec
    address: str                        # where the receiver binds / what the sender reaches
    wrap: Wrap | None = None            # local only: e.g. run inside a network namespace
    ssh_options: tuple[str, ...] = ()   # remote only: extra ssh arguments

    def argv(self, *args: str) -> list[str]:
        """The full command for one agent mode, local or over SSH."""
        if self.host.is_remote:
            return ssh_argv(self.host, [self.host.python or "python3", "-m", AGENT_MODULE, *args],
                            self.ssh_options)
        argv = [self.host.python or sys.executable, "-m", AGENT_MODULE, *args]
        return self.wrap(argv) if self.wrap else argv


def _local_env() -> dict[str, str]:
    """Our environment with this disagg package importable (a checkout need not be installed)."""
    env = dict(os.environ)
    root = str(Path(disagg.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _read_ready(proc: subprocess.Popen[str], where: str) -> int:
    assert proc.stdout is not None
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if ready:
            line = proc.stdout.readline()
            if line.startswith("PROBE-READY "):
                return int(line.split()[1])
            if not line:
                break
        elif proc.poll() is not None:
            break
    proc.kill()
    err = proc.stderr.read() if proc.stderr else ""
    raise LinkError(f"probe receiver on {where} did not start: {err.strip()[-800:] or 'no output'}")


def measure(sender: AgentSide, receiver: AgentSide, *, streams: Sequence[int] = DEFAULT_STREAMS,
            seconds: float = DEFAULT_SECONDS, pings: int = 20) -> tuple[dict[int, float], float]:
    """Run receiver and sender; return ({streams: bit/s}, median RTT in s)."""
    where = f"{receiver.host.name} ({receiver.address})"
    recv = subprocess.Popen(receiver.argv("serve", "--bind", receiver.address, "--port", "0"),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_local_env())
    try:
        port = _read_ready(recv, where)
        budget = len(streams) * (seconds + 30) + 30
        try:
            done = subprocess.run(sender.argv("send", "--host", receiver.address, "--port", str(port),
                                              "--streams", ",".join(map(str, streams)),
                                              "--seconds", str(seconds), "--pings", str(pings)),
                                  capture_output=True, text=True, timeout=budget, env=_local_env(),
                                  check=False)
        except subprocess.TimeoutExpired as exc:
            raise LinkError(f"probe sender on {sender.host.name} -> {receiver.address}:{port} did not finish "
                            f"in {budget:g} s") from exc
        if done.returncode != 0:
            raise LinkError(f"probe sender on {sender.host.name} -> {receiver.address}:{port} failed: "
                            f"{(done.stderr or done.stdout).strip()[-800:]}")
        try:
            result = json.loads(done.stdout.strip().splitlines()[-1])
            rates = {int(k): float(v) for k, v in result["streams_bps"].items()}
            return rates, float(result["rtt_s"])
        except (ValueError, KeyError, IndexError) as exc:
            raise LinkError(f"probe sender on {sender.host.name}: unexpected output {done.stdout[-300:]!r}") from exc
    finally:
        if recv.stdin:
            recv.stdin.close()  # the receiver exits when its stdin closes
        try:
            recv.wait(timeout=5)
        except subprocess.TimeoutExpired:
            recv.kill()
            recv.wait()
        for stream in (recv.stdout, recv.stderr):
            if stream:
                stream.close()


def probe_topology(topo: Topology, *, streams: Sequence[int] = DEFAULT_STREAMS,
                   seconds: float = DEFAULT_SECONDS, ssh_options: Sequence[str] = ()) -> LinkMeasurement:
    """Measure prefill host -> decode host as the topology describes the link.

    ``ssh_options`` are passed to every ssh command (remote hosts only).
    """
    pre_inst, dec_inst = first_pair(topo)
    pre, dec = topo.host_of(pre_inst), topo.host_of(dec_inst)
    if topo.link.type == "emulated":
        # Exactly the link `disagg up` creates: prefill host in a namespace, decode host in the root one.
        with emulated_link(topo) as link:
            sender = AgentSide(pre, link.a.address, lambda argv: link.wrap("a", argv))
            receiver = AgentSide(dec, link.b.address, lambda argv: link.wrap("b", argv))
            rates, rtt = measure(sender, receiver, streams=streams, seconds=seconds)
        path = f"emulated {topo.link.rate_text} (tbf-shaped veth, prefill host in a namespace)"
    else:
        opts = tuple(ssh_options)
        sender, receiver = AgentSide(pre, pre.address, ssh_options=opts), AgentSide(dec, dec.address, ssh_options=opts)
        rates, rtt = measure(sender, receiver, streams=streams, seconds=seconds)
        path = "ssh" if pre.is_remote or dec.is_remote else "local"
    return LinkMeasurement(prefill_host=pre.name, decode_host=dec.name, sender=sender.address,
                           receiver=receiver.address, path=path, method="python", seconds=seconds,
                           streams_bps=rates, rtt_s=rtt, measured_at=now_iso())
