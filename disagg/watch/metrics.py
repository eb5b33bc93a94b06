"""Prometheus text parsed once: the sums, per-label sums and histogram buckets a view reads.

Callers: :mod:`disagg.watch.snapshot` (``disagg top``) reads the proxy's and the engines'
``/metrics`` through :class:`Metrics`; the dashboard test checks every query's metric names
against :func:`exported_names` of a live ``/metrics``. Parsing is prometheus-client's own parser;
text it rejects (a peer that is not a Prometheus exporter) raises :class:`MetricsError`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from disagg.errors import DisaggError

#: the sample names a family of each type exports (prometheus-client strips these suffixes
#: from the family's name; a labelled family with no child yet exports no sample at all)
SUFFIXES: Mapping[str, tuple[str, ...]] = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
}


class MetricsError(DisaggError):
    """A ``/metrics`` answer is not Prometheus text."""


@dataclass(frozen=True)
class Sample:
    """One sample line: its name, labels and value."""

    name: str
    labels: Mapping[str, str]
    value: float


class Metrics:
    """The samples of one ``/metrics`` text."""

    def __init__(self, samples: list[Sample]) -> None:
        self.samples = samples

    @classmethod
    def parse(cls, text: str) -> Metrics:
        """Parse Prometheus text; MetricsError when it is not."""
        try:
            samples = [Sample(s.name, dict(s.labels), float(s.value))
                       for family in text_string_to_metric_families(text) for s in family.samples]
        except (ValueError, TypeError, IndexError, KeyError) as exc:
            raise MetricsError(f"not Prometheus text: {exc}") from exc
        return cls(samples)

    def has(self, name: str) -> bool:
        """True when some sample is named ``name``."""
        return any(s.name == name for s in self.samples)

    def total(self, name: str, **labels: str) -> float:
        """Sum of the samples named ``name`` whose labels include ``labels`` (0.0 if none)."""
        return sum(s.value for s in self.samples
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

    def first(self, *names: str) -> float | None:
        """Sum of the samples of the first of ``names`` that is present (None if none is)."""
        for name in names:
            if self.has(name):
                return self.total(name)
        return None

    def by_labels(self, name: str, *keys: str) -> dict[tuple[str, ...], float]:
        """Samples named ``name`` summed per value of the labels ``keys``."""
        out: dict[tuple[str, ...], float] = {}
        for s in self.samples:
            if s.name == name:
                key = tuple(s.labels.get(k, "") for k in keys)
                out[key] = out.get(key, 0.0) + s.value
        return out

    def buckets(self, histogram: str) -> dict[float, float]:
        """A histogram's cumulative bucket counts by upper bound (``+Inf`` as ``math.inf``),
        summed over its other labels."""
        out: dict[float, float] = {}
        for s in self.samples:
            if s.name == histogram + "_bucket" and "le" in s.labels:
                try:
                    bound = float(s.labels["le"])
                except ValueError:
                    continue
                if not math.isnan(bound):
                    out[bound] = out.get(bound, 0.0) + s.value
        return out


def exported_names(text: str) -> set[str]:
    """Every sample name ``text`` exports or declares: its samples' names, and for each declared
    family the names its type gives it (a labelled counter nobody incremented yet still declares
    ``<name>_total``). MetricsError when ``text`` is not Prometheus text."""
    names: set[str] = set()
    try:
        for family in text_string_to_metric_families(text):
            names.update(s.name for s in family.samples)
            names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ("",)))
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        raise MetricsError(f"not Prometheus text: {exc}") from exc
    return names
