"""A request trace as the workload: when each request arrived and how long its prompt and answer were.

Two public formats, told apart by the first non-blank line:

- CSV with the header ``TIMESTAMP,ContextTokens,GeneratedTokens`` (Azure's LLM inference
  traces, 2023); timestamps like ``2023-11-16 18:17:03.9799600`` (any number of fractional
  digits, an optional ``T``, ``Z`` or ``+HH:MM``), or plain seconds;
- JSONL, one object a line with ``timestamp`` (milliseconds), ``input_length`` and
  ``output_length`` (Mooncake's traces); other keys (``hash_ids``) are ignored.

The file is read a line at a time and reading stops after ``limit`` requests, so a huge
file costs only what is kept. A malformed line (a missing or non-integer field, a
negative length or one beyond MAX_LENGTH, a bad timestamp) is an error naming the file and
line; a row with a zero prompt or answer length is skipped and counted (no request can be
made of it). Rows
whose timestamps go backwards are sorted (stably) by timestamp and counted. A trace
with no usable row is an error. Offsets are relative to the earliest timestamp.
"""

from __future__ import annotations

import csv
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, BinaryIO

from disagg.errors import DisaggError

#: the Azure CSV's columns
CSV_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
#: the Mooncake JSONL's keys
JSONL_KEYS = ("timestamp", "input_length", "output_length")
#: the longest prompt or answer a trace row may give (tokens): beyond any model's context, and
#: without a server's max_model_len to cut it to, a prompt that long would be built as text
MAX_LENGTH = 10_000_000
#: the longest line read (a Mooncake line with its hash_ids is a few KiB)
MAX_LINE = 1 << 20

_TIMESTAMP = re.compile(r"(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d+))?"
                        r"\s*(Z|[+-]\d{2}:?\d{2})?")


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: its arrival (s after the trace's first) and lengths in tokens."""

    offset_s: float
    input_len: int
    output_len: int


@dataclass(frozen=True)
class Trace:
    """A parsed trace file."""

    file: str                           # the path as given
    format: str                         # "azure-csv" | "mooncake-jsonl"
    requests: tuple[TraceRequest, ...]  # by arrival
    rows_read: int                      # data rows read (used + skipped)
    skipped: int = 0                    # rows with a zero length
    reordered: int = 0                  # rows earlier than a row above them (sorted)
    limit: int | None = None            # --trace-limit, when given

    def offsets(self, time_scale: float = 1.0) -> list[float]:
        """Send times (s from the start) at ``time_scale`` (2 = twice as fast)."""
        if not time_scale > 0 or math.isinf(time_scale):
            raise ValueError(f"time scale must be a positive number, got {time_scale}")
        return [r.offset_s / time_scale for r in self.requests]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, without the requests."""
        return {"file": self.file, "format": self.format, "requests": len(self.requests),
                "rows_read": self.rows_read, "skipped_zero_length": self.skipped, "reordered": self.reordered,
                "limit": self.limit, "span_s": self.requests[-1].offset_s if self.requests else 0.0}


def parse_timestamp(text: str) -> int:
    """``2023-11-16 18:17:03.9799600`` (or plain seconds) -> nanoseconds since the epoch (UTC unless
    an offset is given). Raises ValueError. ``datetime`` rejects more than 6 fractional digits,
    so the fraction is read apart (to the nanosecond; further digits are dropped)."""
    text = text.strip()
    m = _TIMESTAMP.fullmatch(text)
    if m is None:
        seconds = float(text)           # a plain number of seconds; ValueError otherwise
        if not math.isfinite(seconds):
            raise ValueError(f"not a finite time: {text!r}")
        return round(seconds * 1e9)
    year, month, day, hour, minute, second = (int(g) for g in m.groups()[:6])
    frac, zone = m.group(7) or "", m.group(8)
    whole = datetime(year, month, day, hour, minute, second, tzinfo=UTC)
    if zone and zone != "Z":
        digits = zone[1:].replace(":", "")
        offset = timedelta(hours=int(digits[:2]), minutes=int(digits[2:]))
        whole -= offset if zone[0] == "+" else -offset
    nanos = int((frac + "000000000")[:9])
    return int(whole.timestamp()) * 1_000_000_000 + nanos


def _length(value: Any, what: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{what} {value!r} is not an integer")
    if isinstance(value, str):
        value = value.strip()
        if not re.fullmatch(r"[+-]?\d+", value):
            raise ValueError(f"{what} {value!r} is not an integer")
        value = int(value)
    elif isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int):
        raise ValueError(f"{what} {value!r} is not an integer")
    if value < 0:
        raise ValueError(f"{what} {value} is negative")
    if value > MAX_LENGTH:
        raise ValueError(f"{what} {value} is beyond {MAX_LENGTH} tokens")
    return value


def _lines(f: BinaryIO, name: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of ``f``, each at most MAX_LINE bytes, decoded one at a time (so a
    byte that is not UTF-8 is reported on its own line)."""
    number = 0
    while True:
        number += 1
        raw = f.readline(MAX_LINE + 1)
        if not raw:
            return
        if len(raw) > MAX_LINE:
            raise DisaggError(f"{name}:{number}: line longer than {MAX_LINE} bytes")
        try:
            yield number, raw.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError as exc:
            raise DisaggError(f"{name}:{number}: not UTF-8 text ({exc.reason})") from None


def _csv_rows(lines: Iterator[tuple[int, str]], name: str, header_line: int,
              header: str) -> Iterator[tuple[int, int, int, int]]:
    cols = [c.strip().lower() for c in next(csv.reader([header]))]
    try:
        where = [cols.index(c.lower()) for c in CSV_COLUMNS]
    except ValueError:
        raise DisaggError(f"{name}:{header_line}: a CSV trace needs the header {','.join(CSV_COLUMNS)} "
                          f"(Azure's format), got {header.strip()!r}") from None
    for number, line in lines:
        if not line.strip():
            continue
        try:
            row = next(csv.reader([line]))
            if len(row) != len(cols):
                raise ValueError(f"{len(row)} fields, the header has {len(cols)}")
            ts = parse_timestamp(row[where[0]])
            yield (number, ts, _length(row[where[1]], CSV_COLUMNS[1]), _length(row[where[2]], CSV_COLUMNS[2]))
        except (ValueError, csv.Error, OverflowError) as exc:
            raise DisaggError(f"{name}:{number}: bad trace row {line.strip()[:120]!r}: {exc}") from None


def _jsonl_rows(lines: Iterator[tuple[int, str]], name: str) -> Iterator[tuple[int, int, int, int]]:
    for number, line in lines:
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict):
                raise ValueError("not a JSON object")
            missing = [k for k in JSONL_KEYS if k not in obj]
            if missing:
                raise ValueError(f"missing {', '.join(missing)}")
            ms = obj["timestamp"]
            if isinstance(ms, bool) or not isinstance(ms, int | float) or not math.isfinite(ms):
                raise ValueError(f"timestamp {ms!r} is not a number of milliseconds")
            yield (number, round(ms * 1_000_000), _length(obj["input_length"], "input_length"),
                   _length(obj["output_length"], "output_length"))
        except (ValueError, OverflowError) as exc:       # json.JSONDecodeError is a ValueError
            raise DisaggError(f"{name}:{number}: bad trace line {line.strip()[:120]!r}: {exc}") from None


def load_trace(path: Path | str, limit: int | None = None) -> Trace:
    """Read the trace at ``path`` (its first ``limit`` usable requests when given).
    Raises DisaggError naming the file (and line) for anything it cannot use."""
    name = str(path)
    if limit is not None and limit < 1:
        raise DisaggError(f"bad trace limit {limit}: at least 1")
    rows: list[tuple[int, int, int]] = []      # (timestamp ns, input, output)
    skipped = read = 0
    try:
        with open(path, "rb") as f:
            lines = _lines(f, name)
            first = next(((n, line) for n, line in lines if line.strip()), None)
            if first is None:
                raise DisaggError(f"{name}: empty trace")
            number, line = first
            if line.lstrip().startswith("{"):
                fmt = "mooncake-jsonl"
                parsed = _jsonl_rows(_chain(first, lines), name)
            else:
                fmt = "azure-csv"
                parsed = _csv_rows(lines, name, number, line)
            for _, ts, inp, out in parsed:
                read += 1
                if inp == 0 or out == 0:
                    skipped += 1
                    continue
                rows.append((ts, inp, out))
                if limit is not None and len(rows) >= limit:
                    break
    except OSError as exc:
        raise DisaggError(f"cannot read the trace {name}: {exc.strerror or exc}") from None
    if not rows:
        raise DisaggError(f"{name}: no usable request in the trace ({read} rows read, {skipped} with a zero length)")
    reordered, latest = 0, rows[0][0]
    for ts, _, _ in rows:
        if ts < latest:
            reordered += 1
        latest = max(latest, ts)
    if reordered:
        rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    return Trace(file=name, format=fmt, rows_read=read, skipped=skipped, reordered=reordered, limit=limit,
                 requests=tuple(TraceRequest((ts - t0) / 1e9, inp, out) for ts, inp, out in rows))


def _chain(first: tuple[int, str], rest: Iterator[tuple[int, str]]) -> Iterator[tuple[int, str]]:
    yield first
    yield from rest


def cap_lengths(input_len: int, output_len: int, max_model_len: int) -> tuple[int, int]:
    """``input_len`` and ``output_len`` fitted into ``max_model_len``: the prompt keeps what it can
    (leaving room for one answer token), the answer gets what is left."""
    if input_len + output_len <= max_model_len:
        return input_len, output_len
    inp = max(1, min(input_len, max_model_len - 1))
    return inp, max(1, min(output_len, max_model_len - inp))
