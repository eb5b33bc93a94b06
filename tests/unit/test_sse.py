"""The one SSE parser: events come out whole whatever the read boundaries."""

from __future__ import annotations

import pytest

from disagg.sse import DONE_EVENT, SSEError, SSEParser, encode_event, encode_json_event

STREAM = (b'data: {"choices":[{"index":0,"text":"a\\n"}]}\n\n'
          b": keep-alive comment\n\n"
          b'data: {"choices":[{"index":0,"text":"b"}]}\r\n\r\n'
          b"event: ping\ndata: x\ndata: y\n\n"
          b'data:{"choices":[]}\r\r'
          b"data: [DONE]\n\n")
EXPECTED = [b'{"choices":[{"index":0,"text":"a\\n"}]}', b'{"choices":[{"index":0,"text":"b"}]}', b"x\ny",
            b'{"choices":[]}', b"[DONE]"]


def parse_in_pieces(stream: bytes, cuts: list[int]) -> list[bytes]:
    parser, out, last = SSEParser(), [], 0
    for cut in [*cuts, len(stream)]:
        out += [e.data for e in parser.feed(stream[last:cut])]
        last = cut
    return out


def test_whole_stream_at_once() -> None:
    events = SSEParser().feed(STREAM)
    assert [e.data for e in events] == EXPECTED
    assert events[2].fields == {"event": b"ping"}
    assert events[-1].done and not events[0].done
    assert events[0].json()["choices"][0]["text"] == "a\n"


@pytest.mark.parametrize("cut", range(1, len(STREAM)))
def test_split_at_every_byte(cut: int) -> None:
    assert parse_in_pieces(STREAM, [cut]) == EXPECTED


def test_one_byte_at_a_time() -> None:
    assert parse_in_pieces(STREAM, list(range(1, len(STREAM)))) == EXPECTED


def test_unfinished_event_waits_for_its_end() -> None:
    parser = SSEParser()
    assert parser.feed(b'data: {"a":') == []
    assert parser.feed(b"1}\n") == []
    assert [e.data for e in parser.feed(b"\n")] == [b'{"a":1}']


def test_cr_at_chunk_end_is_not_taken_for_a_line_end_twice() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: a\r") == []
    assert parser.feed(b"\n\r") == []
    assert [e.data for e in parser.feed(b"\ndata: b\n\n")] == [b"a", b"b"]


def test_oversized_event_is_refused() -> None:
    parser = SSEParser(max_event_bytes=64)
    with pytest.raises(SSEError):
        parser.feed(b"data: " + b"x" * 100)


def test_encoding_round_trips() -> None:
    raw = encode_json_event({"text": "é\n", "n": 1}) + encode_event(b"two\nlines") + DONE_EVENT
    assert raw.startswith(b'data: {"text":"\xc3\xa9\\n","n":1}\n\n')
    events = SSEParser().feed(raw)
    assert [e.data for e in events] == [b'{"text":"\xc3\xa9\\n","n":1}', b"two\nlines", b"[DONE]"]
