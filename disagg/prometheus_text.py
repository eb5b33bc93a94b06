"""Reading engines' and the proxy's Prometheus text (prometheus-client's own parser)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def sample_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the samples named ``name`` whose labels include ``labels`` (0.0 if none)."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += float(sample.value)
    return total


def sample_label(text: str, name: str, label: str) -> str | None:
    """The value of ``label`` on the first sample named ``name`` (e.g. cache_config_info's block_size)."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and label in sample.labels:
                return sample.labels[label]
    return None
