"""Measurements other commands store for ``disagg plan`` to use, on disk.

Four files, all JSON, all written atomically (temp file + rename):

``<run_dir>/measurements/prefill.json`` (written by ``disagg bench``)::

    {
      "<served model name>": {
        "<host name>" or "<host name> [<connector>]": {
          "prompt_tokens_per_s": 11850.0,           # prefill throughput
          "dtype": "auto",                          # the topology's model.dtype it was measured with
          "host": "gamer",                          # the host (the key without the connector)
          "connector": "none",                      # the measured engine's KV connector (none: colocated)
          "measured_at": "2026-11-29T09:12:00+00:00",  # ISO 8601
          "source": "disagg bench ... (free text: how it was measured)"
        }
      }
    }

``<run_dir>/measurements/decode.json`` (written by ``disagg bench prefill`` and ``disagg bench
compare``: :func:`disagg.bench.prefill.probe_decode_step`), keyed the same way::

    {
      "<served model name>": {
        "<host name>" or "<host name> [<connector>]": {
          "fixed_s": 0.0047,                        # an idle decode step with no context KV ...
          "per_kv_byte_s": 1.3e-10,                 # ... plus this per byte of the request's context KV
          "points": [[2162688, 0.0049], ...],       # (context KV bytes, TPOT s) it was fitted to
          "dtype": "auto", "host": "gamer", "connector": "none",
          "measured_at": "2026-11-29T09:12:00+00:00",
          "source": "disagg bench ... (free text: how it was measured)"
        }
      }
    }

An engine's prefill rate and decode step depend on what runs beside its compute: the emulated
house's gamer, one core, prefilled 2,048-token prompts at 1,795 tokens/s colocated (no connector)
and 873 tokens/s as the prefill engine of a NIXL split while NIXL's progress thread spun on the
same core (it now waits for work: docs/engines.md; a connector's threads still share the core).
So both are kept per engine kind: ``connector`` is the KV connector the measured engine ran
(``none`` for an engine of a colocated topology, ``roles.both``).
A lookup for one kind falls back to another kind of the same host (the caller says so); an entry
written before the field existed has the connector unknown (``""``) and serves any kind.

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
            "fixed_s": 0.021,                     # the handoff's fixed cost on this pair ...
            "exposed_per_byte_s": 2.1e-9,         # ... plus this per wire byte of the prompt's KV (optional)
            "points": [[4194304, 0.030], ...],    # (wire bytes, split TTFT - P's TTFT s) it was fitted to
            "measured_at": "2026-11-29T09:12:00+00:00",
            "source": "disagg bench compare ... (free text: how it was measured)"
          }
        }
      }
    }

A handoff's fixed cost is what a split adds to a prefill beyond the part that grows with the
prompt's KV: the connector's own cost, decode's first step over the weights, the link's round
trips. Probed at two prompt lengths, the part that grows is measured too, as
``exposed_per_byte_s`` (:func:`fit_handoff`): what each wire byte adds to the split's TTFT, the
transfer the prefill did not hide and the first step's read of the KV together; ``disagg plan``
then prices a handoff as ``fixed_s + exposed_per_byte_s x wire bytes`` instead of its model of
that part (a streamed transfer on a one-core CPU engine, for one, overlaps its prefill less than
the model assumes). Probed at one length, only ``fixed_s`` is stored, the part that grows taken
as ``disagg plan`` prices it. Both belong to a pair of hosts, a connector and the model (the
first step reads its weights), so they are kept per model, pair and connector (a streamed
handoff apart), in the run directory beside the prefill rates.

A prefill rate holds only for the dtype it was measured with (on a CPU without
native bf16, bf16 prefilled 4 times slower than float32 here): a lookup for
another dtype finds nothing, and an entry written before the field existed
counts as ``auto``.

A missing file means "no measurement"; an unreadable or malformed one is a
:class:`~disagg.errors.StateError` naming the file and the field. Each file's form is written
once, as the pydantic models below (:func:`_load` reads every file with them, strictly: ``"1.0"``
or ``true`` is not a number); the dataclasses are what the rest of the project reads.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from disagg.errors import StateError

PREFILL_FILE = Path("measurements") / "prefill.json"
DECODE_FILE = Path("measurements") / "decode.json"
#: the engine kind of an engine without a KV connector (a colocated topology's, ``roles.both``)
NO_CONNECTOR = "none"
HANDOFF_FILE = Path("measurements") / "handoff.json"
PROBE_SUFFIX = ".probe.json"


def now_iso() -> str:
    """The current time as ISO 8601 with a UTC offset, to the second."""
    return datetime.now(UTC).replace(microsecond=0).isoformat()


def _read_text(path: Path) -> str | None:
    """The file's text, or None where it does not exist."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StateError(f"cannot read {path}: {exc.strerror or exc}") from exc


# --- the stored forms, validated in one place ---------------------------------

_Positive = Annotated[float, Field(gt=0)]
_NonNegative = Annotated[float, Field(ge=0)]


class _Stored(BaseModel):
    """What every stored measurement holds beside its figures; unknown keys are ignored (a newer
    version may add some)."""

    model_config = ConfigDict(extra="ignore", strict=True, frozen=True, allow_inf_nan=False)

    measured_at: str = ""
    source: str = ""


class _EngineEntry(_Stored):
    """An entry of prefill.json or decode.json: one kind of engine of one host."""

    host: str | None = None                      # None: an old entry, the host is its key
    dtype: str = "auto"                          # an old entry: auto
    connector: str = ""                          # an old entry: unknown


class _PrefillEntry(_EngineEntry):
    prompt_tokens_per_s: _Positive
    points: tuple[tuple[_Positive, _Positive], ...] = ()


class _DecodeEntry(_EngineEntry):
    fixed_s: _Positive
    per_kv_byte_s: _NonNegative
    points: tuple[tuple[float, float], ...] = ()


class _HandoffEntry(_Stored):
    fixed_s: _NonNegative
    exposed_per_byte_s: _NonNegative | None = None
    points: tuple[tuple[float, float], ...] = ()


class _LinkProbe(_Stored):
    prefill_host: str
    decode_host: str
    sender: str = ""
    receiver: str = ""
    path: str = ""
    method: str = ""
    seconds: float = 0.0
    #: JSON keys are strings: the stream counts are read from them
    streams_bps: Annotated[dict[int, _Positive], Field(min_length=1, strict=False)]
    rtt_s: float


#: ``{model: {engine key: entry}}``
_PREFILL_FORM = TypeAdapter(dict[str, dict[str, _PrefillEntry]])
_DECODE_FORM = TypeAdapter(dict[str, dict[str, _DecodeEntry]])
#: ``{model: {"P -> D": {connector key: entry}}}``
_HANDOFF_FORM = TypeAdapter(dict[str, dict[str, dict[str, _HandoffEntry]]])
_LINK_FORM = TypeAdapter(_LinkProbe)

_T = TypeVar("_T")


def _load(path: Path, form: TypeAdapter[_T], remedy: str = "") -> _T | None:
    """The file at ``path`` read as ``form``, or None where it does not exist; a
    :class:`StateError` naming the file, the first field wrong and ``remedy`` otherwise."""
    text = _read_text(path)
    if text is None:
        return None
    try:
        return form.validate_json(text)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"] if part != "[key]")
        what = "expected an object" if error["type"] in ("model_type", "dict_type") else error["msg"]
        raise StateError(f"{path}: {where + ': ' if where else ''}{what}{remedy}") from None


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
        text = _read_text(path)
        try:
            data = json.loads(text) if text is not None else {}
        except json.JSONDecodeError as exc:
            raise StateError(f"{path}:{exc.lineno}: invalid JSON: {exc.msg}") from exc
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
    #: the measured engine's KV connector (:data:`NO_CONNECTOR`: none; ``""``: unknown, an old entry)
    connector: str = ""
    #: (prompt tokens, prefill seconds) at each length probed (empty: the rate alone, an old entry)
    points: tuple[tuple[float, float], ...] = ()

    def holds_for(self, dtype: str) -> bool:
        """Whether this rate is one of an engine running ``dtype`` (the topology's ``model.dtype``)."""
        return self.dtype == dtype

    def fit(self) -> tuple[float, float] | None:
        """(seconds per token, seconds per token squared) through :attr:`points`
        (:func:`fit_prefill_time`), or None with fewer than two lengths probed."""
        if len({n for n, _ in self.points}) < 2:
            return None
        return fit_prefill_time(self.points)

    @property
    def engine(self) -> str:
        """What engine it was measured on, for a label: ``an engine without a KV connector``,
        ``an engine with nixl``, or ``an engine of unknown connector``."""
        return engine_words(self.connector)


def fit_prefill_time(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(a, b) of ``prefill seconds = a x n + b x n^2`` for an ``n``-token prompt, least squares
    through ``points`` ((n, seconds), at least two lengths), both at least 0: the linear part is the
    weights' work (and, on an emulated host, the emulation's hold), the square part attention's.
    Where the points say the time grows slower than linearly, it is taken as linear; where they
    say the linear part is negative, as the square part alone."""
    if len({n for n, _ in points}) < 2:
        raise ValueError("a prefill time is fitted from at least two prompt lengths")
    s11 = sum(n * n for n, _ in points)
    s12 = sum(n ** 3 for n, _ in points)
    s22 = sum(n ** 4 for n, _ in points)
    y1 = sum(n * t for n, t in points)
    y2 = sum(n * n * t for n, t in points)
    det = s11 * s22 - s12 * s12
    a = (y1 * s22 - y2 * s12) / det
    b = (s11 * y2 - s12 * y1) / det
    if b < 0:
        return y1 / s11, 0.0
    if a < 0:
        return 0.0, y2 / s22
    return a, b


def engine_words(connector: str) -> str:
    """``none`` -> ``an engine without a KV connector``; ``nixl`` -> ``an engine with nixl``."""
    if connector == NO_CONNECTOR:
        return "an engine without a KV connector"
    return f"an engine with {connector}" if connector else "an engine of unknown connector"


def engine_key(host: str, connector: str) -> str:
    """The key of one host's engine kind in prefill.json and decode.json: the host for an engine
    without a connector (or of unknown connector), ``host [connector]`` otherwise."""
    return host if connector in (NO_CONNECTOR, "") else f"{host} [{connector}]"


def _best_kind(entries: list[tuple[str, str, Any]], host: str, connector: str, dtype: str,
               holds: Callable[[Any], bool]) -> Any | None:
    """Of ``entries`` ((host, connector, measurement)), the one for ``host`` holding ``dtype``: of
    the kind ``connector`` first, then of unknown connector, then of another kind; or None."""
    mine = [(c, m) for h, c, m in entries if h == host and holds(m)]
    for rank in (lambda c: c == connector, lambda c: c == "", lambda c: True):
        for c, m in mine:
            if rank(c):
                return m
    return None


def prefill_path(run_dir: str | Path) -> Path:
    """Where prefill rates live under a run directory."""
    return Path(run_dir) / PREFILL_FILE


def load_prefill(run_dir: str | Path) -> dict[str, dict[str, PrefillMeasurement]]:
    """Every stored prefill rate, ``{model: {key: measurement}}`` (key: :func:`engine_key`, the
    host for an engine without a connector; {} if none)."""
    stored = _load(prefill_path(run_dir), _PREFILL_FORM) or {}
    return {model: {key: PrefillMeasurement(
                model=model, host=e.host if e.host is not None else key,
                prompt_tokens_per_s=e.prompt_tokens_per_s, measured_at=e.measured_at, source=e.source,
                dtype=e.dtype, connector=e.connector, points=e.points)
                    for key, e in engines.items()}
            for model, engines in stored.items()}


def lookup_prefill(run_dir: str | Path, model: str, host: str, dtype: str = "auto",
                   connector: str = NO_CONNECTOR) -> PrefillMeasurement | None:
    """The stored prefill rate of ``model`` in ``dtype`` on an engine of ``host`` running
    ``connector`` (:data:`NO_CONNECTOR`: none), or None (none stored for the host and dtype).
    Without one of that kind: one of unknown connector, then one of another kind (its
    :attr:`PrefillMeasurement.connector` says which). Called by :func:`disagg.planning.host_prefill`."""
    stored = load_prefill(run_dir).get(model, {}).values()
    found: PrefillMeasurement | None = _best_kind([(m.host, m.connector, m) for m in stored], host, connector,
                                                  dtype, lambda m: m.holds_for(dtype))
    return found


def store_prefill(run_dir: str | Path, model: str, host: str, prompt_tokens_per_s: float,
                  source: str, measured_at: str | None = None, dtype: str = "auto",
                  connector: str = "", points: Sequence[tuple[float, float]] = ()) -> Path:
    """Record (or replace) the prefill rate of ``model`` in ``dtype`` (the topology's
    ``model.dtype``) on an engine of ``host`` running ``connector`` (:data:`NO_CONNECTOR`: none;
    ``""``: not known, as for ``disagg bench serve URL --prefill-host``, where the URL may be any
    engine: it then serves every kind), with ``points`` ((prompt tokens, seconds) per length
    probed: :meth:`PrefillMeasurement.fit`); returns the file."""
    if prompt_tokens_per_s <= 0:
        raise ValueError("prompt_tokens_per_s must be positive")
    entry: dict[str, Any] = {"prompt_tokens_per_s": float(prompt_tokens_per_s), "dtype": dtype, "host": host,
                             "connector": connector, "measured_at": measured_at or now_iso(), "source": source}
    if points:
        entry["points"] = [[float(n), float(t)] for n, t in points]

    def put(data: dict[str, Any]) -> None:
        data.setdefault(model, {})[engine_key(host, connector)] = entry

    return _merge_json(prefill_path(run_dir), put)


# --- decode step --------------------------------------------------------------

@dataclass(frozen=True)
class DecodeMeasurement:
    """A measured decode step of one model on one kind of engine of one host: a request decoding
    alone takes ``fixed_s + per_kv_byte_s x its context's KV bytes`` per output token."""

    model: str
    host: str
    connector: str
    dtype: str
    fixed_s: float
    per_kv_byte_s: float
    measured_at: str
    source: str
    points: tuple[tuple[float, float], ...] = ()    # (context KV bytes, TPOT s) it was fitted to

    def step_s(self, kv_bytes: float) -> float:
        """One decode step of a request alone whose context holds ``kv_bytes`` of KV."""
        return self.fixed_s + self.per_kv_byte_s * kv_bytes

    @property
    def date(self) -> str:
        """The day it was measured (``2026-11-29``)."""
        return self.measured_at[:10]


def decode_path(run_dir: str | Path) -> Path:
    """Where decode steps live under a run directory."""
    return Path(run_dir) / DECODE_FILE


def _fit_line(points: Sequence[tuple[float, float]], what: str, lengths: str) -> tuple[float, float]:
    """(intercept, slope): the least-squares line through ``points`` (x, seconds) from at least two
    distinct x (``lengths``, as the error names them). A slope below 0 (noise where the part that
    grows is small beside the fixed one) is taken as 0, the intercept as the mean."""
    if len({x for x, _ in points}) < 2:
        raise ValueError(f"{what} is fitted from at least two {lengths}")
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    slope = (sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points))
    if slope < 0:
        return my, 0.0
    return my - slope * mx, slope


def fit_decode_step(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(fixed_s, per_kv_byte_s): the least-squares line through ``points`` (context KV bytes, TPOT
    seconds), fitted from at least two context lengths (a slope below 0 taken as 0, the step as
    the mean TPOT)."""
    return _fit_line(points, "a decode step", "context lengths")


def store_decode(run_dir: str | Path, model: str, host: str, fixed_s: float, per_kv_byte_s: float,
                 source: str, *, points: Sequence[tuple[float, float]] = (), measured_at: str | None = None,
                 dtype: str = "auto", connector: str = "") -> Path:
    """Record (or replace) the decode step of ``model`` in ``dtype`` on an engine of ``host`` running
    ``connector`` (``""``: not known): ``fixed_s + per_kv_byte_s x context KV bytes`` (:func:`fit_decode_step` over
    ``points``); returns the file. Called by ``disagg bench prefill`` and ``disagg bench compare``."""
    if not fixed_s > 0 or not per_kv_byte_s >= 0:
        raise ValueError("fixed_s must be positive and per_kv_byte_s >= 0")
    entry = {"fixed_s": float(fixed_s), "per_kv_byte_s": float(per_kv_byte_s),
             "points": [[float(x), float(y)] for x, y in points], "dtype": dtype, "host": host,
             "connector": connector, "measured_at": measured_at or now_iso(), "source": source}

    def put(data: dict[str, Any]) -> None:
        data.setdefault(model, {})[engine_key(host, connector)] = entry

    return _merge_json(decode_path(run_dir), put)


def load_decode(run_dir: str | Path) -> dict[str, dict[str, DecodeMeasurement]]:
    """Every stored decode step, ``{model: {key: measurement}}`` (key: :func:`engine_key`; {} if none)."""
    stored = _load(decode_path(run_dir), _DECODE_FORM) or {}
    return {model: {key: DecodeMeasurement(
                model=model, host=e.host if e.host is not None else key, connector=e.connector, dtype=e.dtype,
                fixed_s=e.fixed_s, per_kv_byte_s=e.per_kv_byte_s, measured_at=e.measured_at, source=e.source,
                points=e.points)
                    for key, e in engines.items()}
            for model, engines in stored.items()}


def lookup_decode(run_dir: str | Path, model: str, host: str, dtype: str = "auto",
                  connector: str = NO_CONNECTOR) -> DecodeMeasurement | None:
    """The stored decode step of ``model`` in ``dtype`` on an engine of ``host`` running
    ``connector``, or None; without one of that kind, one of another kind of the same host (its
    ``connector`` says which). Called by ``disagg plan``'s workload model
    (:func:`disagg.workload_plan.engine_decode`)."""
    stored = load_decode(run_dir).get(model, {}).values()
    found: DecodeMeasurement | None = _best_kind([(m.host, m.connector, m) for m in stored], host, connector,
                                                 dtype, lambda m: m.dtype == dtype)
    return found


# --- a pair's handoff ---------------------------------------------------------

@dataclass(frozen=True)
class HandoffMeasurement:
    """The measured cost of a handoff on one prefill -> decode pair of hosts: ``fixed_s``, and with
    ``exposed_per_byte_s`` (probed at two prompt lengths) what each wire byte of KV adds to it."""

    model: str
    prefill_host: str
    decode_host: str
    connector: str
    streaming: bool
    fixed_s: float
    measured_at: str
    source: str
    exposed_per_byte_s: float | None = None
    points: tuple[tuple[float, float], ...] = ()    # (wire bytes, split TTFT - P's TTFT s) it was fitted to

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


def fit_handoff(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(fixed_s, exposed_per_byte_s): the least-squares line through ``points`` (wire bytes of a
    prompt's KV, what a split added to that prompt's TTFT), fitted from at least two prompt
    lengths (a slope below 0 taken as 0, the cost as the mean; a fixed cost below 0 as 0, the
    slope then through the points' mean)."""
    fixed, per_byte = _fit_line(points, "a handoff", "prompt lengths")
    if fixed < 0:
        mx = sum(x for x, _ in points) / len(points)
        return 0.0, sum(y for _, y in points) / len(points) / mx
    return fixed, per_byte


def store_handoff(run_dir: str | Path, model: str, prefill_host: str, decode_host: str, connector: str,
                  streaming: bool, fixed_s: float, source: str, measured_at: str | None = None, *,
                  exposed_per_byte_s: float | None = None, points: Sequence[tuple[float, float]] = ()) -> Path:
    """Record (or replace) the handoff cost of ``model`` on the pair over ``connector``
    (``streaming``: the KV streamed while the prefill computes): ``fixed_s``, and where it was
    probed at two lengths ``exposed_per_byte_s`` (:func:`fit_handoff` over ``points``); returns
    the file. Called by ``disagg bench compare`` (:func:`disagg.bench.compare.probe_handoff`)."""
    if not fixed_s >= 0:
        raise ValueError("fixed_s must be a number >= 0")
    if exposed_per_byte_s is not None and not exposed_per_byte_s >= 0:
        raise ValueError("exposed_per_byte_s must be a number >= 0")
    entry: dict[str, Any] = {"fixed_s": float(fixed_s), "measured_at": measured_at or now_iso(), "source": source}
    if exposed_per_byte_s is not None:
        entry["exposed_per_byte_s"] = float(exposed_per_byte_s)
        entry["points"] = [[float(x), float(y)] for x, y in points]

    def put(data: dict[str, Any]) -> None:
        pairs = data.setdefault(model, {}).setdefault(_pair_key(prefill_host, decode_host), {})
        pairs[_connector_key(connector, streaming)] = entry

    return _merge_json(handoff_path(run_dir), put)


def lookup_handoff(run_dir: str | Path, model: str, prefill_host: str, decode_host: str, connector: str,
                   streaming: bool = False) -> HandoffMeasurement | None:
    """The stored fixed handoff cost of ``model`` on that pair and connector, or None. Called by
    ``disagg plan`` (:func:`disagg.planning.plan_topology`), which then uses it instead of the
    connector's seed (:data:`disagg.routecost.HANDOFF_FIXED_S`)."""
    stored = _load(handoff_path(run_dir), _HANDOFF_FORM) or {}
    e = stored.get(model, {}).get(_pair_key(prefill_host, decode_host), {}).get(_connector_key(connector, streaming))
    if e is None:
        return None
    return HandoffMeasurement(model=model, prefill_host=prefill_host, decode_host=decode_host, connector=connector,
                              streaming=streaming, fixed_s=e.fixed_s, measured_at=e.measured_at, source=e.source,
                              exposed_per_byte_s=e.exposed_per_byte_s, points=e.points)


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
    e = _load(probe_path(topology_file), _LINK_FORM,
              remedy=" (not a probe-link result: delete it and run `disagg probe-link` again)")
    if e is None:
        return None
    return LinkMeasurement(prefill_host=e.prefill_host, decode_host=e.decode_host, sender=e.sender,
                           receiver=e.receiver, path=e.path, method=e.method, seconds=e.seconds,
                           streams_bps=dict(e.streams_bps), rtt_s=e.rtt_s, measured_at=e.measured_at)
