"""kv_transfer_params validation (params.py), case by case: what a client can send an engine."""

from __future__ import annotations

import pytest
from disagg_connectors.socket_connector.params import (
    MAX_REQUEST_ID_CHARS,
    AllowedPeers,
    Declined,
    RemotePrefill,
    check_remote_decode,
    check_remote_prefill,
    is_request_id,
    parse_peer,
)

PEERS = AllowedPeers.parse(["198.18.0.1:5601", "[fd00::1]:7000"])
BLOCK = 16
PROMPT = 40  # three blocks of 16


def good(**changes) -> dict:
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [7, 8, 9],
              "remote_engine_id": "engine-p", "remote_request_id": "cmpl-1-0", "remote_host": "198.18.0.1",
              "remote_port": 5601, "remote_num_tokens": PROMPT, "tp_size": 1, "transfer": "socket",
              "lease_s": 30.0, "remote_prefill_cached_tokens": 0}
    params.update(changes)
    return params


def check(params, prompt: int = PROMPT, peers: AllowedPeers = PEERS):
    return check_remote_prefill(params, num_prompt_tokens=prompt, block_size=BLOCK, peers=peers)


def test_what_the_prefill_side_sends_is_accepted() -> None:
    assert check(good()) == RemotePrefill(request_id="cmpl-1-0", host="198.18.0.1", port=5601,
                                          block_ids=(7, 8, 9), num_tokens=PROMPT, tp_size=1, engine_id="engine-p")


def test_optional_fields_may_be_absent_or_null() -> None:
    minimal = {"do_remote_prefill": True, "remote_block_ids": [7, 8, 9], "remote_request_id": "r",
               "remote_host": "198.18.0.1", "remote_port": 5601}
    res = check(minimal)
    assert isinstance(res, RemotePrefill) and (res.num_tokens, res.tp_size, res.engine_id) == (PROMPT, 1, None)
    assert isinstance(check(good(tp_size=None, lease_s=None, transfer=None, remote_engine_id=None)), RemotePrefill)


def test_fewer_tokens_than_the_prompt_and_ipv6_peers() -> None:
    res = check(good(remote_num_tokens=17, remote_block_ids=[1, 2]))
    assert isinstance(res, RemotePrefill) and res.num_tokens == 17
    assert isinstance(check(good(remote_host="fd00:0::1", remote_port=7000)), RemotePrefill)


@pytest.mark.parametrize("params", [None, {}, {"do_remote_prefill": False}, {"do_remote_prefill": None},
                                    {"do_remote_decode": True}])
def test_not_a_remote_prefill(params) -> None:
    assert check(params) is None


BAD = [
    # (case id, params, field named)
    ("params-a-list", [1, 2], "kv_transfer_params"),
    ("flag-string", good(do_remote_prefill="yes"), "do_remote_prefill"),
    ("flag-int", good(do_remote_prefill=1), "do_remote_prefill"),
    ("both-flags", good(do_remote_decode=True), "do_remote_decode"),
    ("decode-flag-string", good(do_remote_decode="no"), "do_remote_decode"),
    ("other-transfer", good(transfer="nixl"), "transfer"),
    ("port-string", good(remote_port="not-a-port"), "remote_port"),
    ("port-digits", good(remote_port="5601"), "remote_port"),
    ("port-float", good(remote_port=5601.0), "remote_port"),
    ("port-bool", good(remote_port=True), "remote_port"),
    ("port-zero", good(remote_port=0), "remote_port"),
    ("port-too-big", good(remote_port=65536), "remote_port"),
    ("port-missing", good(remote_port=None), "remote_port"),
    ("host-not-a-peer", good(remote_host="198.18.0.2"), "remote_host"),
    ("port-not-a-peer", good(remote_port=5602), "remote_host"),
    ("host-int", good(remote_host=3325165569), "remote_host"),
    ("host-with-space", good(remote_host="198.18.0.1 "), "remote_host"),
    ("host-huge", good(remote_host="a" * 10_000), "remote_host"),
    ("host-missing", good(remote_host=None), "remote_host"),
    ("request-id-missing", good(remote_request_id=None), "remote_request_id"),
    ("request-id-empty", good(remote_request_id=""), "remote_request_id"),
    ("request-id-huge", good(remote_request_id="r" * (MAX_REQUEST_ID_CHARS + 1)), "remote_request_id"),
    ("request-id-newline", good(remote_request_id="r\nFAKE LOG LINE"), "remote_request_id"),
    ("request-id-space", good(remote_request_id="cmpl-a b-0"), "remote_request_id"),
    ("request-id-tab", good(remote_request_id="cmpl-a\tb-0"), "remote_request_id"),
    ("request-id-non-ascii", good(remote_request_id="cmpl-\u00e9t\u00e9-0"), "remote_request_id"),
    ("request-id-int", good(remote_request_id=12), "remote_request_id"),
    ("engine-id-dict", good(remote_engine_id={"a": 1}), "remote_engine_id"),
    ("tp-zero", good(tp_size=0), "tp_size"),
    ("tp-huge", good(tp_size=10**12), "tp_size"),
    ("tp-string", good(tp_size="1"), "tp_size"),
    ("tp-past-last-port", good(remote_port=65535, tp_size=2), "tp_size"),
    ("lease-negative", good(lease_s=-1), "lease_s"),
    ("lease-huge", good(lease_s=1e12), "lease_s"),
    ("lease-bool", good(lease_s=True), "lease_s"),
    ("tokens-zero", good(remote_num_tokens=0), "remote_num_tokens"),
    ("tokens-past-prompt", good(remote_num_tokens=PROMPT + 1), "remote_num_tokens"),
    ("tokens-string", good(remote_num_tokens="40"), "remote_num_tokens"),
    ("blocks-missing", good(remote_block_ids=None), "remote_block_ids"),
    ("blocks-a-string", good(remote_block_ids="7,8,9"), "remote_block_ids"),
    ("blocks-too-many", good(remote_block_ids=[7, 8, 9, 10]), "remote_block_ids"),
    ("blocks-too-few", good(remote_block_ids=[7, 8]), "remote_block_ids"),
    ("blocks-a-million", good(remote_block_ids=list(range(10**6))), "remote_block_ids"),
    ("blocks-negative", good(remote_block_ids=[7, -8, 9]), "remote_block_ids"),
    ("blocks-strings", good(remote_block_ids=["7", "8", "9"]), "remote_block_ids"),
    ("blocks-floats", good(remote_block_ids=[7.0, 8.0, 9.0]), "remote_block_ids"),
    ("blocks-bools", good(remote_block_ids=[True, False, 9]), "remote_block_ids"),
    ("blocks-huge-id", good(remote_block_ids=[7, 8, 2**63]), "remote_block_ids"),
    ("blocks-repeated", good(remote_block_ids=[7, 7, 9]), "remote_block_ids"),
    ("blocks-nested", good(remote_block_ids=[[7], [8], [9]]), "remote_block_ids"),
]


@pytest.mark.parametrize(("params", "field"), [(p, f) for _, p, f in BAD], ids=[c for c, _, _ in BAD])
def test_crafted_params_are_declined_naming_the_field(params, field: str) -> None:
    res = check(params)
    assert isinstance(res, Declined), res
    assert res.field == field, res
    assert len(res.reason) < 400 and "\n" not in res.reason  # one short line, not the whole value


@pytest.mark.parametrize("rid", [
    "cmpl-" + "x" * 128 + "-0-1a2b3c4d",                     # the proxy's longest id with vLLM's affixes
    "chatcmpl-3f2a-0",
    "r" * MAX_REQUEST_ID_CHARS,                              # the limit itself
    "!~",
])
def test_request_ids_both_sides_accept(rid: str) -> None:
    assert is_request_id(rid)
    assert not isinstance(check(good(remote_request_id=rid)), Declined)


@pytest.mark.parametrize("rid", [
    "", "r" * (MAX_REQUEST_ID_CHARS + 1), "a b", "a\tb", "a\nb", "a\x00b", "a\x7fb", "caf\u00e9", "\u2028",
    12, None, b"cmpl-1", ["cmpl-1"],
])
def test_request_ids_both_sides_refuse(rid: object) -> None:
    assert not is_request_id(rid)
    declined = check(good(remote_request_id=rid))
    assert isinstance(declined, Declined) and declined.field == "remote_request_id"


def test_without_peers_only_loopback_is_allowed() -> None:
    none = AllowedPeers()
    assert isinstance(check(good(remote_host="127.0.0.1", remote_port=40000), peers=none), RemotePrefill)
    assert isinstance(check(good(remote_host="::1", remote_port=40000), peers=none), RemotePrefill)
    assert isinstance(check(good(remote_host="localhost", remote_port=1), peers=none), RemotePrefill)
    for host in ("198.18.0.1", "10.0.0.1", "example.com", "0.0.0.0"):
        res = check(good(remote_host=host), peers=none)
        assert isinstance(res, Declined) and res.field == "remote_host", host


def test_peer_matching_normalises_addresses_but_never_resolves_names() -> None:
    with pytest.raises(ValueError, match=r"\[address\]:port"):
        AllowedPeers.parse("fd00::1:7000")  # ambiguous: IPv6 needs brackets
    peers = AllowedPeers.parse("[fd00::1]:7000,[fd00:0:0::2]:7001,Host-A:5601")
    assert peers.allows("fd00:0:0:0:0:0:0:1", 7000) and peers.allows("[fd00::2]", 7001)
    assert peers.allows("host-a", 5601) and not peers.allows("host-a", 5602)
    assert not peers.allows("127.0.0.1", 5601)  # configured peers replace the loopback default


@pytest.mark.parametrize("text", ["", "host", "host:", "host:0", "host:65536", "host:x", ":5601", "a b:1",
                                  "[::1]5601", "::1:5601x"])
def test_bad_peer_entries_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_peer(text)


def test_peer_entries_parse() -> None:
    assert parse_peer("198.18.0.1:5601") == ("198.18.0.1", 5601)
    assert parse_peer("[::1]:7000") == ("::1", 7000)
    with pytest.raises(ValueError):
        AllowedPeers.parse({"host": "a"})


@pytest.mark.parametrize(("params", "expected"), [
    (None, False), ({}, False), ({"do_remote_decode": False}, False), ({"do_remote_decode": None}, False),
    ({"do_remote_decode": True, "do_remote_prefill": False, "remote_host": None, "remote_port": None,
      "remote_block_ids": None, "remote_engine_id": None}, True),
])
def test_remote_decode_accepted(params, expected: bool) -> None:
    assert check_remote_decode(params) is expected


@pytest.mark.parametrize(("params", "field"), [
    ({"do_remote_decode": "yes"}, "do_remote_decode"),
    ({"do_remote_decode": 1}, "do_remote_decode"),
    ({"do_remote_decode": True, "do_remote_prefill": True}, "do_remote_prefill"),
    ({"do_remote_decode": True, "do_remote_prefill": "no"}, "do_remote_prefill"),
    ("do_remote_decode", "kv_transfer_params"),
])
def test_remote_decode_declined(params, field: str) -> None:
    res = check_remote_decode(params)
    assert isinstance(res, Declined) and res.field == field
