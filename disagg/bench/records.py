"""What one benchmark request recorded.

All times are seconds on the client's monotonic clock (``time.perf_counter``)
relative to the start of the run, so a record can be written to JSON and read
back without losing meaning. The definitions follow ``vllm bench serve``:
the first token time is the first streamed chunk that carries ``choices``;
the end is the last such chunk (the trailing usage chunk carries no token).
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    """One request: when it was sent, every token chunk's arrival, its size and fate, and the path the
    proxy served it by."""

    index: int                          # position in the workload
    klass: str                          # prompt class name (short / medium / long ...)
    send: float                         # request sent, s since run start
    prompt_tokens: int                  # from usage (falls back to the intended length)
    output_tokens: int = 0              # from usage (falls back to the chunk count)
    chunk_times: list[float] = field(default_factory=list)   # each token chunk, s since run start
    error: str | None = None            # None = success
    route: str | None = None            # the proxy's X-Disagg-Route (split, local, whole, fallback), if sent

    @property
    def success(self) -> bool:
        """True when the request ended normally and streamed at least one token chunk."""
        return self.error is None and bool(self.chunk_times)

    @property
    def first_token(self) -> float | None:
        """Arrival of the first token chunk (s since run start)."""
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def end(self) -> float | None:
        """Arrival of the last token chunk (s since run start)."""
        return self.chunk_times[-1] if self.chunk_times else None

    @property
    def ttft(self) -> float | None:
        """Time to first token, s."""
        return None if self.first_token is None else self.first_token - self.send

    @property
    def e2el(self) -> float | None:
        """End-to-end latency (send -> last token chunk), s."""
        return None if self.end is None else self.end - self.send

    @property
    def itls(self) -> list[float]:
        """Gaps between successive token chunks, s."""
        t = self.chunk_times
        return [b - a for a, b in itertools.pairwise(t)]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (times rounded to microseconds)."""
        d = asdict(self)
        d["send"] = round(self.send, 6)
        d["chunk_times"] = [round(t, 6) for t in self.chunk_times]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestRecord:
        """Inverse of :meth:`to_dict`."""
        return cls(index=int(d["index"]), klass=str(d["klass"]), send=float(d["send"]),
                   prompt_tokens=int(d["prompt_tokens"]), output_tokens=int(d.get("output_tokens", 0)),
                   chunk_times=[float(t) for t in d.get("chunk_times", [])], error=d.get("error"),
                   route=d.get("route"))
