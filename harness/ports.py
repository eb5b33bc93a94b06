"""Loopback ports for the tests' servers, picked below the kernel's ephemeral port range.

Every test that needs a port for a server it starts (an engine, its KV listener, the proxy, a
stand-in) takes it from here. The usual trick, binding port 0 and closing the socket, hands out a
port from the ephemeral range, and so does the kernel to every socket the started processes
bind to port 0 or connect from (vLLM's ZMQ sockets, gloo, UCX) before the server binds the port
it was given. That race made a decode engine's NIXL handshake listener fail with "Address
already in use" on a port its own worker had just taken, and `disagg up` wait out its 900 s
start-up timeout. Ports below the ephemeral range are never handed out by the kernel, so only an
explicit choice can take them, and this module hands out each port once per test session.
Sessions split by pytest-xdist (``-n``) take disjoint shares of that range, one per worker.
"""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

#: the lowest port handed out (above the registered ports that services commonly use)
LOWEST = 20000
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_handed_out: set[int] = set()


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux's default where the file cannot be read)."""
    try:
        low, high = (int(v) for v in _RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def worker_share() -> tuple[int, int]:
    """(index, count): this pytest-xdist worker's share of the ports below the ephemeral range is
    those ``port % count == index`` (workers ``gw0`` .. ``gwN`` of ``-n N+1`` never pick the same
    port); (0, 1), the whole range, outside xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker.startswith("gw") and worker[2:].isdigit() and count.isdigit() and int(count) > 0:
        return int(worker[2:]) % int(count), int(count)
    return 0, 1


def _bindable(port: int, host: str) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports free on ``host`` right now, below the ephemeral range and never
    handed out before in this process; where the range leaves too little room below it, ports
    from binding port 0 (the old race, named in the module docstring)."""
    low, _ = ephemeral_range()
    ports: list[int] = []
    index, workers = worker_share()
    if (low - LOWEST) // workers >= 1000:
        share = range(LOWEST + (index - LOWEST) % workers, low, workers)
        for port in random.sample(share, len(share)):
            if len(ports) == count:
                break
            if port not in _handed_out and _bindable(port, host):
                ports.append(port)
    while len(ports) < count:
        with socket.socket() as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in _handed_out and port not in ports:
            ports.append(port)
    _handed_out.update(ports)
    return ports


def free_port(host: str = "127.0.0.1") -> int:
    """One port, as :func:`free_ports` picks them."""
    return free_ports(1, host)[0]
