"""merge_metrics: the replicas' Prometheus texts as one exposition, each sample labelled by replica.

Per-replica series (not pre-summed ones) keep every metric meaningful, gauges included;
`sum without (replica) (...)` gives the cluster's totals. Plain Python, no Ray.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector


def merge_metrics(texts: Iterable[tuple[str, str]], extra: Iterable[Metric] = ()) -> bytes:
    """One exposition of (replica, text) pairs, each sample with a `replica` label, plus
    `extra` families (the cluster's own)."""
    families: dict[str, Metric] = {}
    for replica, text in texts:
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type)
            for sample in family.samples:
                merged.add_sample(sample.name, {**sample.labels, "replica": replica}, sample.value, sample.timestamp)
    registry = CollectorRegistry()
    registry.register(_Fixed(list(families.values()) + list(extra)))
    return generate_latest(registry)


def sample_total(text: str, sample_name: str) -> float:
    """The sum of every sample named `sample_name` in an exposition (tests, benchmarks)."""
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == sample_name)


class _Fixed(Collector):
    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> Iterator[Any]:
        yield from self.families
