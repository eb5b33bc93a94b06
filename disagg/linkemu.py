"""Shaped links between network namespaces: a slow network on one machine.

``EmulatedLink(rate_bps)`` creates two network namespaces (``disagg-<tag>-a``
and ``disagg-<tag>-b``) joined by a veth pair with addresses 198.18.x.y/30
(the benchmarking range, RFC 2544), and shapes the egress of **both** ends
with ``tc qdisc ... tbf rate R burst B latency 50ms`` (this kernel has no
netem; measured here: 2.5 Gb/s needs a burst of at least 1 MB).
Commands run inside either namespace with :meth:`EmulatedLink.popen` /
:meth:`EmulatedLink.run`; processes inside one namespace talk over its own
unshaped loopback, processes on opposite ends over the shaped veth.

With ``b_in_root=True`` side b stays in the root namespace (the launcher puts
the prefill engine behind the link in namespace a and keeps the decode engine
and the proxy, which clients must reach, in the root namespace).

Use it as a context manager; :meth:`EmulatedLink.close` is idempotent, kills
whatever still runs in the two namespaces and deletes them (the veth pair goes
with them). Creating namespaces needs root (CAP_SYS_ADMIN + CAP_NET_ADMIN) and
iproute2; anything missing is a :class:`~disagg.errors.LinkError` that names
the command and the reason. Used by ``disagg probe-link`` and its tests, and
meant for the launcher and ``disagg bench`` (``link: {type: emulated}``).
"""

from __future__ import annotations

import enum
import itertools
import os
import shutil
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from disagg.errors import LinkError

NAMESPACE_PREFIX = "disagg-"
#: tbf queue limit expressed as time: packets wait at most this long
TBF_LATENCY = "50ms"
#: smallest tbf bucket: 1 MiB (2.5 Gb/s reaches ~2.4 Gb/s only from 1 MB up)
MIN_BURST_BYTES = 1 << 20
#: the bucket also holds this much time at the shaped rate (fast links)
BURST_SECONDS = 0.004
COMMAND_TIMEOUT_S = 20.0

_counter = itertools.count()


def default_burst(rate_bps: float) -> int:
    """tbf bucket size in bytes for a rate: max(1 MiB, 4 ms of traffic)."""
    return max(MIN_BURST_BYTES, int(rate_bps / 8 * BURST_SECONDS))


def _ip(*args: str, what: str) -> subprocess.CompletedProcess[str]:
    return run_checked(["ip", *args], what=what)


def run_checked(argv: Sequence[str], *, what: str) -> subprocess.CompletedProcess[str]:
    """Run a short administrative command; LinkError naming ``what`` and stderr if it fails."""
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S,
                              check=False)
    except FileNotFoundError as exc:
        raise LinkError(f"{what}: `{argv[0]}` is not installed (install iproute2)") from exc
    except subprocess.TimeoutExpired as exc:
        raise LinkError(f"{what}: `{' '.join(argv)}` did not finish in {COMMAND_TIMEOUT_S:g} s") from exc
    if proc.returncode != 0:
        err = (proc.stderr or proc.stdout).strip()
        hint = ""
        if "permitted" in err or "Permission denied" in err:
            hint = " (network namespaces and tc need root: CAP_SYS_ADMIN and CAP_NET_ADMIN)"
        raise LinkError(f"{what}: `{' '.join(argv)}` failed: {err or f'exit status {proc.returncode}'}{hint}")
    return proc


def remove_namespace(namespace: str) -> None:
    """Kill every process inside ``namespace`` and delete it (its veth pairs go with it)."""
    proc = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, check=False)
    for pid in proc.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)


def netns_unavailable_reason() -> str | None:
    """Why network namespaces cannot be created here, or None when they can.

    Creates and deletes a scratch namespace to find out (for tests that skip).
    """
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    name = f"{NAMESPACE_PREFIX}check-{os.getpid()}"
    try:
        _ip("netns", "add", name, what="creating a scratch network namespace")
    except LinkError as exc:
        return str(exc)
    subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
    return None


@dataclass(frozen=True)
class LinkEnd:
    """One side of the link: its namespace ("" for the root namespace), interface and address."""

    namespace: str
    interface: str
    address: str


class LinkState(enum.Enum):
    """NEW -> OPEN -> CLOSED; a closed link cannot be reopened."""

    NEW = "new"
    OPEN = "open"
    CLOSED = "closed"


class EmulatedLink:
    """Two namespaces joined by a tbf-shaped veth pair (see the module docstring)."""

    def __init__(self, rate_bps: float, *, tag: str | None = None, subnet: int | None = None,
                 burst_bytes: int | None = None, addresses: tuple[str, str] | None = None,
                 b_in_root: bool = False) -> None:
        if rate_bps <= 0:
            raise LinkError("rate_bps must be positive")
        seq = next(_counter)
        self.tag = tag or f"{os.getpid() % 100000}x{seq}"
        if len(self.tag) > 11 or not self.tag.replace("-", "").isalnum():
            raise LinkError(f"tag {self.tag!r}: at most 11 letters, digits or dashes (interface names)")
        if addresses is None:
            index = (subnet if subnet is not None else (os.getpid() * 7 + seq)) % (256 * 64)
            base = f"198.18.{index // 64}."
            host = (index % 64) * 4
            addresses = (base + str(host + 1), base + str(host + 2))
        self.rate_bps = rate_bps
        self.burst_bytes = burst_bytes or default_burst(rate_bps)
        self.b_in_root = b_in_root
        self.a = LinkEnd(f"{NAMESPACE_PREFIX}{self.tag}-a", f"dg{self.tag}a", addresses[0])
        self.b = LinkEnd("" if b_in_root else f"{NAMESPACE_PREFIX}{self.tag}-b", f"dg{self.tag}b", addresses[1])
        self.state = LinkState.NEW

    def __repr__(self) -> str:
        return (f"EmulatedLink({self.a.namespace} {self.a.address} <-> {self.b.namespace} {self.b.address}, "
                f"{self.rate_bps:g} bit/s, {self.state.value})")

    # --- lifecycle -----------------------------------------------------------

    def open(self) -> EmulatedLink:
        """Create the namespaces, the veth pair, the addresses and the shaping."""
        if self.state is not LinkState.NEW:
            raise LinkError(f"{self!r} cannot be opened twice")
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                raise LinkError(f"emulated link: `{tool}` is not installed (install iproute2)")
        self.state = LinkState.OPEN
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def _namespaced(self, end: LinkEnd, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", end.namespace, *argv] if end.namespace else argv

    def _create(self) -> None:
        a, b = self.a, self.b
        ends = (a, b) if b.namespace else (a,)
        for end in ends:
            _ip("netns", "add", end.namespace, what=f"creating network namespace {end.namespace}")
        peer = ["netns", b.namespace] if b.namespace else []
        _ip("link", "add", a.interface, "netns", a.namespace, "type", "veth", "peer", "name", b.interface,
            *peer, what=f"creating veth pair {a.interface}/{b.interface}")
        for end in (a, b):
            what = f"configuring {end.interface} in {end.namespace or 'the root namespace'}"
            scope = ["-n", end.namespace] if end.namespace else []
            _ip(*scope, "addr", "add", f"{end.address}/30", "dev", end.interface, what=what)
            _ip(*scope, "link", "set", end.interface, "up", what=what)
            if end.namespace:
                _ip(*scope, "link", "set", "lo", "up", what=what)
            run_checked(self._namespaced(end, ["tc", "qdisc", "replace", "dev", end.interface, "root", "tbf",
                                               "rate", f"{int(self.rate_bps)}bit", "burst", str(self.burst_bytes),
                                               "latency", TBF_LATENCY]),
                        what=f"shaping {end.interface} with tc tbf")

    def close(self) -> None:
        """Kill what still runs in the namespaces and delete them; safe to call again.

        With ``b_in_root`` only side a's namespace goes (taking the veth pair with it);
        nothing in the root namespace is touched.
        """
        if self.state is LinkState.CLOSED:
            return
        self.state = LinkState.CLOSED
        for end in (self.a, self.b):
            if end.namespace:
                remove_namespace(end.namespace)
        if self.b_in_root:
            subprocess.run(["ip", "link", "del", self.b.interface], capture_output=True, check=False)

    def __enter__(self) -> EmulatedLink:
        return self.open()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # --- running commands inside ---------------------------------------------

    def _end(self, side: str) -> LinkEnd:
        if side not in ("a", "b"):
            raise LinkError(f"side must be 'a' or 'b', got {side!r}")
        if self.state is not LinkState.OPEN:
            raise LinkError(f"{self!r} is not open")
        return self.a if side == "a" else self.b

    def wrap(self, side: str, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed to run inside side ``a`` or ``b``'s namespace (as is for a root side)."""
        return self._namespaced(self._end(side), list(argv))

    def popen(self, side: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside a namespace; the caller owns (and must reap) the process."""
        return subprocess.Popen(self.wrap(side, argv), **kwargs)

    def run(self, side: str, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """Run ``argv`` inside a namespace to completion (``subprocess.run`` keywords apply)."""
        return subprocess.run(self.wrap(side, argv), **kwargs)
