"""Settings of the socket connector from kv_connector_extra_config and env."""

from __future__ import annotations

import pytest
from disagg_connectors.socket_connector.config import (
    MAX_PENDING_HANDSHAKES,
    MAX_PENDING_HANDSHAKES_PER_SOURCE,
    ConfigError,
    SocketSettings,
)

ENV = {"DISAGG_KV_SECRET": "s" * 64}


def test_defaults_and_overrides() -> None:
    s = SocketSettings.load({"host": "10.0.0.1", "port": 5601, "kv_lease_duration": 12, "streams": 4}, ENV)
    assert (s.host, s.port, s.lease_s, s.streams, s.secret) == ("10.0.0.1", 5601, 12.0, 4, b"s" * 64)
    d = SocketSettings.load(None, {**ENV, "DISAGG_KV_HOST": "10.0.0.2", "DISAGG_KV_PORT": "7000"})
    assert (d.host, d.port, d.lease_s, d.streams, d.idle_wait_ms) == ("10.0.0.2", 7000, 30.0, 2, 2.0)


def test_secret_is_required_and_named() -> None:
    with pytest.raises(ConfigError, match="DISAGG_KV_SECRET"):
        SocketSettings.load({}, {})
    with pytest.raises(ConfigError, match=r"MY_SECRET.*at least 16"):
        SocketSettings.load({"secret_env": "MY_SECRET"}, {"MY_SECRET": "short"})


def test_producer_needs_a_port() -> None:
    with pytest.raises(ConfigError, match="port"):
        SocketSettings.load({}, ENV, need_port=True)


@pytest.mark.parametrize(("key", "value"), [("streams", 0), ("port", "x"), ("port", 70000), ("lease_s", "soon")])
def test_bad_values_name_the_key(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"kv_connector_extra_config.{key}"):
        SocketSettings.load({key: value}, ENV)


def test_peers_from_config_or_env_default_loopback_only() -> None:
    s = SocketSettings.load({"peers": ["198.18.0.1:5601", "[fd00::1]:5601"]}, ENV)
    assert s.peers.allows("198.18.0.1", 5601) and s.peers.allows("fd00::1", 5601)
    assert not s.peers.allows("198.18.0.1", 5602) and not s.peers.allows("127.0.0.1", 5601)
    env = SocketSettings.load({}, {**ENV, "DISAGG_KV_PEERS": "10.0.0.1:5601,10.0.0.2:5601"})
    assert env.peers.allows("10.0.0.2", 5601) and not env.peers.allows("10.0.0.3", 5601)
    default = SocketSettings.load({}, ENV)
    assert not default.peers.configured
    assert default.peers.allows("127.0.0.1", 5601) and not default.peers.allows("10.0.0.1", 5601)


@pytest.mark.parametrize("peers", ["10.0.0.1", ["10.0.0.1:0"], [5601], {"a": 1}, ["::1:5601"]])
def test_bad_peers_name_the_key(peers: object) -> None:
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.peers"):
        SocketSettings.load({"peers": peers}, ENV)


def test_listener_limits_and_lease_bound() -> None:
    s = SocketSettings.load({"max_pending_handshakes": 4, "max_pending_handshakes_per_source": 2,
                             "handshake_timeout_s": 2}, ENV)
    assert (s.max_pending_handshakes, s.max_pending_handshakes_per_source, s.handshake_timeout_s) == (4, 2, 2.0)
    d = SocketSettings.load({}, ENV)
    assert (d.max_pending_handshakes, d.max_pending_handshakes_per_source, d.handshake_timeout_s) == (
        MAX_PENDING_HANDSHAKES, MAX_PENDING_HANDSHAKES_PER_SOURCE, 5.0) == (64, 4, 5.0)
    assert d.allowed_peers == ()
    for key, value in (("max_pending_handshakes", 0), ("max_pending_handshakes_per_source", 0),
                       ("handshake_timeout_s", 0), ("kv_lease_duration", 7200),
                       ("kv_lease_duration", float("nan"))):
        with pytest.raises(ConfigError, match=f"kv_connector_extra_config.{key}"):
            SocketSettings.load({key: value}, ENV)


@pytest.mark.parametrize(("raw", "expected"), [
    (["198.18.0.2", "fd00::7", "decode-1.lan", "localhost."], ("198.18.0.2", "fd00::7", "decode-1.lan", "localhost.")),
    ("127.0.0.1, 127.0.0.2", ("127.0.0.1", "127.0.0.2")),
    (["127.0.0.1", "127.0.0.1"], ("127.0.0.1",)),
    (None, ()), ("", ()), ([], ()),
])
def test_allowed_peers_are_addresses_or_host_names(raw: object, expected: tuple[str, ...]) -> None:
    assert SocketSettings.load({"allowed_peers": raw}, ENV).allowed_peers == expected


@pytest.mark.parametrize("raw", [
    ["198.18.0.2:5601"], ["[fd00::7]"], ["10.0.0.0/8"], ["a b"], ["-bad.lan"], ["x" * 64 + ".lan"], [""], [5601],
    {"host": "a"}, 7, ["decode\n1"], ["10.0.0.1"] * 300,
])
def test_bad_allowed_peers_name_the_key(raw: object) -> None:
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.allowed_peers"):
        SocketSettings.load({"allowed_peers": raw}, ENV)
