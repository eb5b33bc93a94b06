"""SuffixStrip (disagg/proxy/relay.py): the relay's removal of a handoff's request-id suffix from
an engine's reply, chunk by chunk, whatever the chunk boundaries."""

from __future__ import annotations

import itertools

import pytest

from disagg.proxy.relay import SuffixStrip

SUFFIX = b"-push0123456789abcdef"
EVENTS = (b'data: {"id":"cmpl-abc-push0123456789abcdef","choices":[{"text":"-p"}]}\n\n'
          b'data: {"id":"cmpl-abc-push0123456789abcdef","choices":[{"text":"-push01"}]}\n\n'
          b"data: [DONE]\n\n")
EXPECTED = EVENTS.replace(SUFFIX, b"")


@pytest.mark.parametrize("size", [1, 2, 5, 7, 20, 21, 22, 64, len(EVENTS)])
def test_every_occurrence_goes_whatever_the_chunks(size: int) -> None:
    strip = SuffixStrip(SUFFIX)
    chunks = [EVENTS[i:i + size] for i in range(0, len(EVENTS), size)]
    out = b"".join(strip.feed(c) for c in chunks) + strip.flush()
    assert out == EXPECTED
    assert b"push0123" not in out and b'"text":"-push01"' in out    # a partial look-alike stays


def test_an_events_end_is_never_held() -> None:
    """Only a tail that may start the suffix waits for the next chunk: each whole event goes out
    as it arrives (the client's token timing is the engine's)."""
    strip = SuffixStrip(SUFFIX)
    for event in EVENTS.split(b"\n\n")[:-1]:
        assert strip.feed(event + b"\n\n") == (event + b"\n\n").replace(SUFFIX, b"")
    assert strip.flush() == b""


def test_a_held_tail_that_was_not_the_suffix_comes_out() -> None:
    strip = SuffixStrip(SUFFIX)
    assert strip.feed(b"abc-pu") == b"abc"
    assert strip.feed(b"ll") == b"-pull"
    assert strip.feed(b"x-push") == b"x"
    assert strip.flush() == b"-push"
    assert list(itertools.chain(strip.feed(b""), strip.flush())) == []


def test_an_empty_suffix_is_refused() -> None:
    with pytest.raises(ValueError):
        SuffixStrip(b"")
