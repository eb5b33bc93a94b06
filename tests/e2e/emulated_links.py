"""What the e2e tests of a deployment across an emulated link (test_emulated_link.py,
test_pd_nixl_push.py) read of the link `disagg up` made: whether its prefill host's namespace is
there, the bytes the root namespace's end received, and what `disagg down` left of it."""

from __future__ import annotations

import subprocess
from pathlib import Path

from disagg.linkemu import EmulatedLink


def namespace_listed(link: EmulatedLink) -> bool:
    """Whether ``ip netns list`` lists the link's far end (the prefill host's namespace)."""
    return link.a.namespace in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def received_bytes(link: EmulatedLink) -> int:
    """Bytes the root namespace's end of the veth received (from the prefill host's namespace)."""
    return int(Path(f"/sys/class/net/{link.b.interface}/statistics/rx_bytes").read_text())


def left_of(link: EmulatedLink) -> list[str]:
    """What is left of ``link`` (its namespace, the root end of its veth); [] when nothing."""
    left = [f"namespace {link.a.namespace}"] if namespace_listed(link) else []
    if Path(f"/sys/class/net/{link.b.interface}").exists():
        left.append(f"interface {link.b.interface}")
    return left
