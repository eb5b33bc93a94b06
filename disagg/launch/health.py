"""Readiness probes and port checks."""

from __future__ import annotations

import errno
import shlex
import socket
import urllib.error
import urllib.request

from disagg.launch.processes import run_remote
from disagg.ssh import ssh_prefix
from disagg.topology import HostSpec, Timeouts


def http_status(url: str, timeout: float = 3.0) -> int | None:
    """GET ``url``; its HTTP status, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, OSError, ValueError):
        return None


def local_port_free(address: str, port: int) -> bool:
    """True when ``address:port`` can be bound here (TCP)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((address, port))
        except OSError as exc:
            if exc.errno == errno.EADDRNOTAVAIL:
                # Not an address of this machine: the caller decides; treat as free here.
                return True
            return False
    return True


_REMOTE_BIND_CHECK = (
    "import socket,sys\n"
    "bad=[]\n"
    "for a,p in [{pairs}]:\n"
    "    s=socket.socket(socket.AF_INET6 if ':' in a else socket.AF_INET)\n"
    "    s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
    "    try: s.bind((a,p))\n"
    "    except OSError: bad.append(p)\n"
    "    finally: s.close()\n"
    "print(' '.join(map(str,bad)))\n"
)


def busy_ports(host: HostSpec, python: str, ports: list[int], *,
               ssh_timeout: float = Timeouts.ssh_command) -> list[int]:
    """The ports among ``ports`` already bound on ``host``'s address (over SSH if remote, one call)."""
    if not host.is_remote:
        return [p for p in ports if not local_port_free(host.address, p)]
    pairs = ",".join(f"({host.address!r},{p})" for p in ports)
    script = _REMOTE_BIND_CHECK.format(pairs=pairs)
    out = run_remote(ssh_prefix(host), f"{shlex.quote(python)} -c {shlex.quote(script)}", timeout=ssh_timeout)
    return [int(p) for p in out.split()]
