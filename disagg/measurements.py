"""Measurements other commands store for ``disagg plan`` to use, on disk.

Three files, all JSON, all written atomically (temp file + rename):

``<run_dir>/measurements/prefill.json`` (written by ``disagg bench``)::

    {
      "<served model name>": {
        "<host name>": {
          "prompt_tokens_per_s": 11850.0,           # prefill throughput
          "dtype": "auto",                          # the topology's model.dtype it was measured with
          "measured_at": "2026-11-29T09:12:00+00:00",  # ISO 8601
          "source": "disagg bench ... (free text: how it was measured)"
        }
      }
    }

``<topology dir>/<topology stem>.probe.json`` (written by ``disagg probe-link``)::

    {
      "prefill_host": "gamer", "decode_host": "workstation",
      "sender": "192.168.1.20", "receiver": "192.168.1.30",
      "path": "ssh", "method": "python",
      "seconds": 3.0,
      "streams_bps": {"1": 2.31e9, "2": 2.35e9, "4": 2.35e9},
      "rtt_s": 0.00021,
      "measured_at": "2026-11-29T09:12:00+00:00"
    }

``<run_dir>/measurements/handoff.json`` (written by ``disagg bench compare``:
:func:`disagg.bench.prefill.probe_handoff_fixed`)::

    {
      "<served model name>": {
        "<prefill host> -> <decode host>": {
          "<connector>" or "<connector> streamed": {
            "fixed_s": 0.052,                     # the handoff's fixed cost on this pair
            "measured_at": "2026-11-29T09:12:00+00:00",
            "source": "disagg bench compare ... (free text: how it was measured)"
          }
        }
      }
    }

A handoff's fixed cost is what a split adds to a prefill beyond the part that grows with the
prompt's KV (as ``disagg plan`` prices that part): the connector's own cost, decode's first step
over the weights, the link's round trips. It belongs to a pair of hosts, a connector and the
model (the first step reads its weights), so it is kept per model, pair and connector (a streamed
handoff apart), in the run directory beside the prefill rates.

A prefill rate holds only for the dtype it was measured with (on a CPU without
native bf16, bf16 prefilled 4 times slower than float32 here): a lookup for
another dtype finds nothing, and an entry written before the field existed
counts as ``auto``.

A missing file means "no measurement"; an unreadable or malformed one is a
:class:`~disagg.errors.StateError` naming the file.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from disagg.errors import StateError

PREFILL_FILE = Path("measurements") / "prefill.json"
HANDOFF_FILE = Path("measurements") / "handoff.json"
PROBE_SUFFIX = ".probe.json"


def now_iso() -> str:
    """The current time as ISO 8601 with a UTC offset, to the second."""
    return datetime.now(UTC).replace(microsecond=0).isoformat()


def _read_json(path: Path) -> Any | None:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StateError(f"cannot read {path}: {exc.strerror or exc}") from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise StateError(f"{path}:{exc.lineno}: invalid JSON: {exc.msg}") from exc


def _write_json(path: Path, data: Any) -> Path:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        tmp.replace(path)
    except OSError as exc:
        raise StateError(f"cannot write {path}: {exc.strerror or exc}") from exc
    return path


def _merge_json(path: Path, update: Callable[[dict[str, Any]], None]) -> Path:
    """Read the object of model names at ``path`` ({} when missing), ``update`` it, write it back,
    all under a lock beside it: concurrent benches merge, never overwrite. Returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = _read_json(path) or {}
        if not isinstance(data, dict):
            raise StateError(f"{path}: expected an object of model names")
        update(data)
        return _write_json(path, data)


# --- prefill throughput ------------------------------------------------------

@dataclass(frozen=True)
class PrefillMeasurement:
    """A measured prefill rate of one model on one host."""

    model: str
    host: str
    prompt_tokens_per_s: float
    measured_at: str
    source: str
    dtype: str = "auto"

    def holds_for(self, dtype: str) -> bool:
        """Whether this rate is one of an engine running ``dtype`` (the topology's ``model.dtype``)."""
        return self.dtype == dtype


def prefill_path(run_dir: str | Path) -> Path:
    """Where prefill rates live under a run directory."""
    return Path(run_dir) / PREFILL_FILE


def load_prefill(run_dir: str | Path) -> dict[str, dict[str, PrefillMeasurement]]:
    """Every stored prefill rate, ``{model: {host: measurement}}`` ({} if none)."""
    path = prefill_path(run_dir)
    data = _read_json(path)
    if data is None:
        return {}
    out: dict[str, dict[str, PrefillMeasurement]] = {}
    if not isinstance(data, dict):
        raise StateError(f"{path}: expected an object of model names")
    for model, hosts in data.items():
        if not isinstance(hosts, dict):
            raise StateError(f"{path}: {model}: expected an object of host names")
        for host, entry in hosts.items():
            rate = entry.get("prompt_tokens_per_s") if isinstance(entry, dict) else None
            if isinstance(rate, bool) or not isinstance(rate, (int, float)) or rate <= 0:
                raise StateError(f"{path}: {model}.{host}.prompt_tokens_per_s: expected a positive number")
            out.setdefault(model, {})[host] = PrefillMeasurement(
                model=model, host=host, prompt_tokens_per_s=float(rate),
                measured_at=str(entry.get("measured_at", "")), source=str(entry.get("source", "")),
                dtype=str(entry.get("dtype", "auto")))
    return out


def lookup_prefill(run_dir: str | Path, model: str, host: str, dtype: str = "auto") -> PrefillMeasurement | None:
    """The stored prefill rate of ``model`` in ``dtype`` on ``host``, or None (none stored, or
    one measured with another dtype)."""
    found = load_prefill(run_dir).get(model, {}).get(host)
    return found if found is not None and found.holds_for(dtype) else None


def store_prefill(run_dir: str | Path, model: str, host: str, prompt_tokens_per_s: float,
                  source: str, measured_at: str | None = None, dtype: str = "auto") -> Path:
    """Record (or replace) the prefill rate of ``model`` in ``dtype`` (the topology's
    ``model.dtype``) on ``host``; returns the file."""
    if prompt_tokens_per_s <= 0:
        raise ValueError("prompt_tokens_per_s must be positive")
    entry = {"prompt_tokens_per_s": float(prompt_tokens_per_s), "dtype": dtype,
             "measured_at": measured_at or now_iso(), "source": source}

    def put(data: dict[str, Any]) -> None:
        data.setdefault(model, {})[host] = entry

    return _merge_json(prefill_path(run_dir), put)


# --- a pair's handoff ---------------------------------------------------------

@dataclass(frozen=True)
class HandoffMeasurement:
    """The measured fixed cost of a handoff on one prefill -> decode pair of hosts."""

    model: str
    prefill_host: str
    decode_host: str
    connector: str
    streaming: bool
    fixed_s: float
    measured_at: str
    source: str

    @property
    def date(self) -> str:
        """The day it was measured (``2026-11-29``), or the stored text when it is not ISO 8601."""
        return self.measured_at[:10]


def handoff_path(run_dir: str | Path) -> Path:
    """Where handoff measurements live under a run directory."""
    return Path(run_dir) / HANDOFF_FILE


def _pair_key(prefill_host: str, decode_host: str) -> str:
    return f"{prefill_host} -> {decode_host}"


def _connector_key(connector: str, streaming: bool) -> str:
    return f"{connector} streamed" if streaming else connector


def store_handoff(run_dir: str | Path, model: str, prefill_host: str, decode_host: str, connector: str,
                  streaming: bool, fixed_s: float, source: str, measured_at: str | None = None) -> Path:
    """Record (or replace) the fixed handoff cost of ``model`` on the pair over ``connector``
    (``streaming``: the KV streamed while the prefill computes); returns the file. Called by
    ``disagg bench compare`` (:mod:`disagg.bench.compare`)."""
    if not fixed_s >= 0:
        raise ValueError("fixed_s must be a number >= 0")
    entry = {"fixed_s": float(fixed_s), "measured_at": measured_at or now_iso(), "source": source}

    def put(data: dict[str, Any]) -> None:
        pairs = data.setdefault(model, {}).setdefault(_pair_key(prefill_host, decode_host), {})
        pairs[_connector_key(connector, streaming)] = entry

    return _merge_json(handoff_path(run_dir), put)


def lookup_handoff(run_dir: str | Path, model: str, prefill_host: str, decode_host: str, connector: str,
                   streaming: bool = False) -> HandoffMeasurement | None:
    """The stored fixed handoff cost of ``model`` on that pair and connector, or None. Called by
    ``disagg plan`` (:func:`disagg.planning.plan_topology`), which then uses it instead of the
    connector's seed (:data:`disagg.routecost.HANDOFF_FIXED_S`)."""
    path = handoff_path(run_dir)
    data = _read_json(path)
    if data is None:
        return None
    try:
        entry = data.get(model, {}).get(_pair_key(prefill_host, decode_host), {}).get(
            _connector_key(connector, streaming))
    except AttributeError:
        raise StateError(f"{path}: expected {{model: {{pair: {{connector: entry}}}}}}") from None
    if entry is None:
        return None
    fixed = entry.get("fixed_s") if isinstance(entry, dict) else None
    if isinstance(fixed, bool) or not isinstance(fixed, (int, float)) or fixed < 0:
        raise StateError(f"{path}: {model}.{_pair_key(prefill_host, decode_host)}.fixed_s: expected a number >= 0")
    return HandoffMeasurement(model=model, prefill_host=prefill_host, decode_host=decode_host, connector=connector,
                              streaming=streaming, fixed_s=float(fixed), measured_at=str(entry.get("measured_at", "")),
                              source=str(entry.get("source", "")))


# --- link probe ----------------------------------------------------------------

@dataclass(frozen=True)
class LinkMeasurement:
    """TCP throughput and round-trip time measured between prefill and decode hosts."""

    prefill_host: str
    decode_host: str
    sender: str                         # address the sender ran at (prefill side)
    receiver: str                       # address the receiver listened on (decode side)
    path: str                           # local | ssh | emulated <rate>
    method: str                         # python (our agent) or iperf3
    seconds: float                      # duration of each throughput run
    streams_bps: dict[int, float]       # parallel streams -> payload bits per second
    rtt_s: float
    measured_at: str

    @property
    def best_streams(self) -> int:
        """The stream count that moved the most data."""
        return max(self.streams_bps, key=lambda n: self.streams_bps[n])

    @property
    def best_bps(self) -> float:
        """The highest throughput over the stream counts tried."""
        return self.streams_bps[self.best_streams]

    def to_json(self) -> dict[str, Any]:
        """The on-disk form (stream counts as string keys)."""
        return {"prefill_host": self.prefill_host, "decode_host": self.decode_host,
                "sender": self.sender, "receiver": self.receiver, "path": self.path,
                "method": self.method, "seconds": self.seconds,
                "streams_bps": {str(k): v for k, v in sorted(self.streams_bps.items())},
                "rtt_s": self.rtt_s, "measured_at": self.measured_at}


def probe_path(topology_file: str | Path) -> Path:
    """``topologies/house-2g5.yaml`` -> ``topologies/house-2g5.probe.json``."""
    p = Path(topology_file)
    return p.with_name(p.stem + PROBE_SUFFIX)


def store_link(topology_file: str | Path, measurement: LinkMeasurement) -> Path:
    """Write the probe result next to the topology; returns the file."""
    return _write_json(probe_path(topology_file), measurement.to_json())


def load_link(topology_file: str | Path) -> LinkMeasurement | None:
    """The probe result stored next to the topology, or None."""
    path = probe_path(topology_file)
    data = _read_json(path)
    if data is None:
        return None
    try:
        streams = {int(k): float(v) for k, v in data["streams_bps"].items()}
        if not streams or min(streams.values()) <= 0:
            raise ValueError("streams_bps must hold positive rates")
        return LinkMeasurement(
            prefill_host=str(data["prefill_host"]), decode_host=str(data["decode_host"]),
            sender=str(data.get("sender", "")), receiver=str(data.get("receiver", "")),
            path=str(data.get("path", "")), method=str(data.get("method", "")),
            seconds=float(data.get("seconds", 0.0)), streams_bps=streams,
            rtt_s=float(data["rtt_s"]), measured_at=str(data.get("measured_at", "")))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise StateError(f"{path}: not a probe-link result ({exc}); delete it and run "
                         "`disagg probe-link` again") from exc
