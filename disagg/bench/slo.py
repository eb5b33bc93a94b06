"""Service-level objectives: ``--slo ttft=2s,tpot=100ms,e2el=30s``."""

from __future__ import annotations

import re
from dataclasses import dataclass

SLO_METRICS = ("ttft", "tpot", "e2el")
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s)?\s*$")


def parse_duration(text: str) -> float:
    """``2s`` / ``100ms`` / ``0.5`` (seconds) -> seconds. Raises ValueError naming the text."""
    match = _DURATION_RE.match(text)
    if not match:
        raise ValueError(f"bad duration {text!r}: expected a number with ms or s, e.g. 100ms or 2s")
    value = float(match.group(1))
    return value / 1000.0 if match.group(2) == "ms" else value


@dataclass(frozen=True)
class SLO:
    """Per-request latency limits in seconds; None = not constrained."""

    ttft: float | None = None
    tpot: float | None = None
    e2el: float | None = None

    @property
    def empty(self) -> bool:
        """True when no limit is set (then goodput is not reported)."""
        return self.ttft is None and self.tpot is None and self.e2el is None

    def describe(self) -> str:
        """``ttft<=2000ms, tpot<=100ms``."""
        parts = [f"{name}<={value * 1000:g}ms" for name in SLO_METRICS
                 if (value := getattr(self, name)) is not None]
        return ", ".join(parts) or "none"

    def to_dict(self) -> dict[str, float]:
        """Only the limits that are set, in seconds."""
        return {name: value for name in SLO_METRICS if (value := getattr(self, name)) is not None}


#: no limits: goodput and attainment are not reported
NO_SLO = SLO()


def parse_slo(text: str | None) -> SLO:
    """Parse ``ttft=2s,tpot=100ms[,e2el=30s]``; an empty string means no SLO.

    Raises ValueError naming the offending item.
    """
    if not text or not text.strip():
        return SLO()
    values: dict[str, float] = {}
    for item in text.split(","):
        name, sep, value = item.partition("=")
        name = name.strip().lower()
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"bad SLO item {item.strip()!r}: expected NAME=DURATION with NAME one of "
                             f"{', '.join(SLO_METRICS)}, e.g. ttft=2s,tpot=100ms")
        if name in values:
            raise ValueError(f"SLO {name!r} given twice")
        values[name] = parse_duration(value)
    return SLO(**values)
