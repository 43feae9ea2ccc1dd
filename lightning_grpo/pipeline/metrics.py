"""Metric windows: values appended as they are measured, reduced to one number per key when logged.

The reduction follows TRL's async GRPO, so the same names mean the same thing: a `(numerator, denominator)` pair is a
rate (Σnum / Σden, never a mean of ratios), a `total` word in the name is a counter (producers push increments,
summed over the window; `lightning_grpo.training.step_metrics.StepMetrics` adds the windows up into the run's totals that get
logged), a `max` or `min` word is an extremum, anything else is a gauge (window mean). NaN values are skipped.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping

MetricValue = float | tuple[float, float]


def append_metric(metrics: dict[str, list] | None, key: str, value: float) -> None:
    """Append `value` under `key` of a TRL-style metric sink (a plain dict or a defaultdict of lists)."""
    if metrics is not None:
        metrics.setdefault(key, []).append(value)


def is_counter(key: str) -> bool:
    """Whether `key` names a counter: a `total` word in its last part (`reward_pool/errors_total`)."""
    return "total" in key.split("/")[-1].split("_")


def reduce_metric(key: str, values: list[MetricValue]) -> float:
    """One window of `values` logged under `key`, reduced to the number that gets logged."""
    values = [v for v in values if isinstance(v, tuple) or not math.isnan(v)]
    if not values:
        return float("nan")
    if isinstance(values[0], tuple):
        numerator, denominator = (sum(part) for part in zip(*values, strict=True))
        return numerator / denominator if denominator else float("nan")
    numbers = [value for value in values if not isinstance(value, tuple)]  # a window holds one kind of value
    if is_counter(key):
        return float(sum(numbers))
    words = key.split("/")[-1].split("_")
    if "max" in words:
        return float(max(numbers))
    if "min" in words:
        return float(min(numbers))
    return float(sum(numbers) / len(numbers))


class MetricWindow:
    """Collects metric values until `flush()` reduces and clears them. Not thread-safe: one owner thread."""

    def __init__(self) -> None:
        self._values: dict[str, list[MetricValue]] = defaultdict(list)

    def add(self, key: str, value: MetricValue) -> None:
        self._values[key].append(value)

    def update(self, values: Mapping[str, MetricValue | list[MetricValue]]) -> None:
        """Add a dict of values; a list value adds each of its items (a metrics sink of lists, like TRL's)."""
        for key, value in values.items():
            if isinstance(value, list):
                self._values[key].extend(value)
            else:
                self._values[key].append(value)

    def flush(self) -> dict[str, float]:
        reduced = {key: reduce_metric(key, values) for key, values in self._values.items() if values}
        self._values.clear()
        return {key: value for key, value in reduced.items() if not math.isnan(value)}
