"""EmulatedLink naming, sizing and its errors (creating namespaces is tested in tests/net)."""

from __future__ import annotations

import pytest

from disagg import linkemu
from disagg.errors import LinkError
from disagg.linkemu import MIN_BURST_BYTES, EmulatedLink, LinkState, default_burst, run_checked


def test_names_and_addresses() -> None:
    link = EmulatedLink(1e9, tag="t1", subnet=65)
    assert (link.a.namespace, link.b.namespace) == ("disagg-t1-a", "disagg-t1-b")
    assert (link.a.address, link.b.address) == ("198.18.1.5", "198.18.1.6")   # one /30
    assert len(link.a.interface) <= 15 and link.state is LinkState.NEW


def test_burst_is_at_least_1_mib_and_grows_with_rate() -> None:
    assert default_burst(1e9) == MIN_BURST_BYTES
    assert default_burst(100e9) == int(100e9 / 8 * 0.004)


def test_bad_arguments() -> None:
    with pytest.raises(LinkError, match="tag"):
        EmulatedLink(1e9, tag="far-too-long-tag")
    with pytest.raises(LinkError, match="rate"):
        EmulatedLink(0)


def test_missing_ip_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linkemu.shutil, "which", lambda tool: None)
    link = EmulatedLink(1e9, tag="t2")
    with pytest.raises(LinkError, match=r"`ip` is not installed"):
        link.open()
    assert linkemu.netns_unavailable_reason() == "`ip` (iproute2) is not installed"


def test_failed_command_names_what_and_why() -> None:
    with pytest.raises(LinkError, match=r"^deleting x: `ip netns del disagg-no-such-ns-\d+` failed: .+"):
        run_checked(["ip", "netns", "del", f"disagg-no-such-ns-{id(object())}"], what="deleting x")
    with pytest.raises(LinkError, match="not installed"):
        run_checked(["/nonexistent/ip-tool"], what="x")


def test_close_before_open_is_harmless_and_final() -> None:
    link = EmulatedLink(1e9, tag="t3")
    link.close()
    link.close()
    assert link.state is LinkState.CLOSED
    with pytest.raises(LinkError, match="cannot be opened twice"):
        link.open()
    with pytest.raises(LinkError, match="not open"):
        link.wrap("a", ["true"])
