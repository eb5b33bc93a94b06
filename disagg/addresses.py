"""Host addresses: is a topology's ``address`` one at all, and is it this machine's?

``address_problem`` is syntax only (an IPv4 or IPv6 address, or a host name of RFC 1123
labels); ``disagg.topology`` refuses what it finds. ``is_this_machine`` answers from this
machine's own facts, never from DNS: the addresses of its interfaces in the current network
namespace (psutil), loopback, the wildcard addresses, ``localhost`` and its own host name. A
host name that is neither is "not this machine". ``disagg.topology_checks`` asks it for the
hosts without ``ssh``.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Iterable

#: one label of a host name (RFC 1123: letters, digits, hyphens inside, at most 63)
_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")
#: addresses that mean every address of this machine (a bind address)
WILDCARDS = ("0.0.0.0", "::")


def address_problem(text: str) -> str | None:
    """What is wrong with ``text`` as a host address (None when it is an IP address or a host name)."""
    if not text:
        return "is empty; expected an IP address or a host name"
    try:
        ipaddress.ip_address(text)
        return None
    except ValueError:
        pass
    name = text[:-1] if text.endswith(".") else text
    labels = name.split(".")
    if len(name) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        return (f"{text!r} is not an address: expected an IPv4 or IPv6 address or a host name "
                "(letters, digits, '-' and '.')")
    if labels[-1].isdigit():
        return f"{text!r} is not an address: it looks like an IPv4 address but is not one"
    return None


def local_addresses() -> frozenset[str]:
    """The IP addresses of this machine's interfaces (in this network namespace), without scope ids."""
    import psutil
    found: set[str] = set()
    for entries in psutil.net_if_addrs().values():
        for entry in entries:
            if entry.family in (socket.AF_INET, socket.AF_INET6):
                found.add(entry.address.split("%", 1)[0])
    return frozenset(found)


def is_this_machine(address: str, local: Iterable[str] | None = None, hostname: str | None = None) -> bool:
    """Whether engines here can bind ``address``: one of ``local`` (default: :func:`local_addresses`),
    loopback, a wildcard, ``localhost`` or this machine's host name (default: ``socket.gethostname``).
    No DNS lookup."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        name = address.rstrip(".").lower()
        own = (hostname if hostname is not None else socket.gethostname()).lower()
        return name in ("localhost", own, own.split(".")[0]) or name.endswith(".localhost")
    if ip.is_loopback or address in WILDCARDS or ip.is_unspecified:
        return True
    addresses = local_addresses() if local is None else local
    return any(_same(ip, other) for other in addresses)


def _same(ip: ipaddress.IPv4Address | ipaddress.IPv6Address, other: str) -> bool:
    try:
        return ipaddress.ip_address(other.split("%", 1)[0]) == ip
    except ValueError:
        return False
