"""Measurements other commands store for ``disagg plan`` to use, on disk.

Two files, both JSON, both written atomically (temp file + rename):

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
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from disagg.errors import StateError

PREFILL_FILE = Path("measurements") / "prefill.json"
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
    path = prefill_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:  # concurrent benches merge, never overwrite
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = _read_json(path) or {}
        if not isinstance(data, dict):
            raise StateError(f"{path}: expected an object of model names")
        data.setdefault(model, {})[host] = {
            "prompt_tokens_per_s": float(prompt_tokens_per_s),
            "dtype": dtype,
            "measured_at": measured_at or now_iso(),
            "source": source,
        }
        return _write_json(path, data)


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
