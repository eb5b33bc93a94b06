"""Server-sent events: the one incremental parser for every SSE stream disagg reads.

Engines (vLLM, SGLang) write ``data: {json}\\n\\n`` per event and ``data: [DONE]``
last; a TCP read may end anywhere, in the middle of an event, a line or a
``\\r\\n``. :class:`SSEParser` is fed the chunks as they arrive and returns
the events completed so far, whatever the chunk boundaries (the WHATWG
event-stream rules: lines end with CRLF, LF or CR; an empty line ends an
event; ``data`` lines of one event are joined with ``\\n``; a leading space
after the colon is dropped; comments and other fields are kept apart).

Callers: the proxy's relay (counting token events), its batch merger
(re-indexing each event) and the LMCache/SGLang handoffs; ``disagg bench``'s
client (timing token events).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

DONE = b"[DONE]"

#: largest event the parser buffers (a streamed chunk with logprobs is a few KiB);
#: a peer sending more without an event end is not an SSE stream
MAX_EVENT_BYTES = 16 * 1024 * 1024


class SSEError(ValueError):
    """The byte stream is not a usable event stream (an event over :data:`MAX_EVENT_BYTES`)."""


@dataclass
class SSEEvent:
    """One dispatched event: its ``data`` lines joined, and any other fields."""

    data: bytes
    #: other fields (``event``, ``id``, ``retry``), last value wins
    fields: dict[str, bytes] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        """True for the ``data: [DONE]`` sentinel."""
        return self.data.strip() == DONE

    def json(self) -> Any:
        """The data as JSON (raises ``ValueError`` when it is not)."""
        return json.loads(self.data)


def encode_event(data: bytes) -> bytes:
    """``data`` as one SSE event, in the engines' own framing (multi-line data split into lines)."""
    return b"".join(b"data: " + line + b"\n" for line in data.split(b"\n")) + b"\n"


def encode_json_event(value: Any) -> bytes:
    """A JSON value as one event, compact as vLLM writes it."""
    return encode_event(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())


DONE_EVENT = encode_event(DONE)


class SSEParser:
    """Incremental parser: ``feed(chunk)`` returns the events that chunk completed."""

    def __init__(self, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self._buffer = bytearray()
        self._data: list[bytes] = []
        self._fields: dict[str, bytes] = {}
        self._event_bytes = 0
        self._max = max_event_bytes

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """Add ``chunk``; return every event it completed, in order."""
        self._buffer += chunk
        events: list[SSEEvent] = []
        start = 0
        buf = self._buffer
        while True:
            lf = buf.find(b"\n", start)
            cr = buf.find(b"\r", start)
            if cr >= 0 and (lf < 0 or cr < lf):
                if cr + 1 == len(buf):
                    break  # a CR at the end may be the first half of CRLF: wait for more
                end, nxt = cr, cr + 2 if buf[cr + 1] == 0x0A else cr + 1
            elif lf >= 0:
                end, nxt = lf, lf + 1
            else:
                break
            event = self._line(bytes(buf[start:end]))
            if event is not None:
                events.append(event)
            start = nxt
        del buf[:start]
        if len(buf) + self._event_bytes > self._max:
            raise SSEError(f"an SSE event exceeds {self._max} bytes")
        return events

    def _line(self, line: bytes) -> SSEEvent | None:
        if not line:  # an event ends; one without data lines is dropped (as browsers do)
            event = SSEEvent(b"\n".join(self._data), self._fields) if self._data else None
            self._data, self._fields, self._event_bytes = [], {}, 0
            return event
        self._event_bytes += len(line)
        if line.startswith(b":"):
            return None  # comment
        name, colon, value = line.partition(b":")
        if colon and value.startswith(b" "):
            value = value[1:]
        if name == b"data":
            self._data.append(value)
        else:
            self._fields[name.decode("utf-8", errors="replace")] = value
        return None
