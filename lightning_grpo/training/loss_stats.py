"""Sums and extremes behind the loss metrics, so that micro-batches, ranks and updates aggregate exactly."""

from __future__ import annotations

import math
from typing import Any

import torch

_COUNT = "#count"  # suffix of a mean's denominator
_MIN = "#min"  # suffix of a minimum, kept as the maximum of the negated values so every extreme reduces with MAX


class LossStats:
    """What one micro-batch's loss measured, as additive sums and maxima (TRL's metric names).

    A mean is kept as a weighted sum and its weight (`add_mean`), a total as a sum (`add_total`), an extreme as a
    maximum (`add_max`, `add_min`), so
    `+` over a step's micro-batches, then a SUM all-reduce of `sums()` and a MAX all-reduce of `maxima()` over ranks
    (`from_reduced` rebuilds the stats), gives the metrics of the whole step: token means over every rank's trained
    tokens, extremes over every completion. Every rank must add the same names (the options decide them, not the
    data), so the reduced tensors line up.
    """

    def __init__(self, sums: dict[str, torch.Tensor] | None = None, maxima: dict[str, torch.Tensor] | None = None):
        self._sums = dict(sums or {})
        self._maxima = dict(maxima or {})

    def add_mean(self, name: str, values: torch.Tensor, weights: torch.Tensor) -> None:
        """Count `values` with `weights` (same shape; 0 = not counted) towards the mean `name`."""
        weights = weights.float()
        self._add(name, (values.float() * weights).sum())
        self._add(name + _COUNT, weights.sum())

    def add_total(self, name: str, value: torch.Tensor) -> None:
        """Add `value` to the total `name` (a sum over micro-batches and ranks, such as the step's loss)."""
        self._add(name, value.float().sum())

    def add_max(self, name: str, values: torch.Tensor) -> None:
        """Count `values` towards the maximum `name` (none: NaN unless another part has some)."""
        self._maximum(name, values.float().max() if values.numel() else values.new_full((), -math.inf).float())

    def add_min(self, name: str, values: torch.Tensor) -> None:
        """Count `values` towards the minimum `name`."""
        self.add_max(name + _MIN, -values)

    def _add(self, name: str, value: torch.Tensor) -> None:
        self._sums[name] = self._sums[name] + value if name in self._sums else value

    def _maximum(self, name: str, value: torch.Tensor) -> None:
        self._maxima[name] = torch.maximum(self._maxima[name], value) if name in self._maxima else value

    def __add__(self, other: LossStats) -> LossStats:
        merged = LossStats(self._sums, self._maxima)
        for name, value in other._sums.items():
            merged._add(name, value)
        for name, value in other._maxima.items():
            merged._maximum(name, value)
        return merged

    def count(self, name: str) -> float:
        """The total weight counted towards the mean `name` (0 when nothing was)."""
        return float(self._sums.get(name + _COUNT, 0.0))

    def sums(self) -> torch.Tensor:
        """The additive values in name order, for a SUM all-reduce."""
        return _stack(self._sums)

    def maxima(self) -> torch.Tensor:
        """The extremes in name order, for a MAX all-reduce."""
        return _stack(self._maxima)

    def from_reduced(self, sums: torch.Tensor, maxima: torch.Tensor) -> LossStats:
        """These stats' names with the reduced values (`sums()` and `maxima()` after the all-reduces)."""
        return LossStats(
            dict(zip(sorted(self._sums), sums.unbind(0), strict=True)),
            dict(zip(sorted(self._maxima), maxima.unbind(0), strict=True)),
        )

    def metrics(self) -> dict[str, float]:
        """Metric name to value: means (NaN where nothing was counted), totals, maxima and minima (NaN where none)."""
        out = {}
        for name in self._sums:
            if name.endswith(_COUNT):
                continue
            if name + _COUNT not in self._sums:
                out[name] = float(self._sums[name])
                continue
            count = float(self._sums[name + _COUNT])
            out[name] = float(self._sums[name]) / count if count else math.nan
        for name, value in self._maxima.items():
            value = float(value)
            if name.endswith(_MIN):
                out[name.removesuffix(_MIN)] = -value if value != -math.inf else math.nan
            else:
                out[name] = value if value != -math.inf else math.nan
        return out


def _stack(values: dict[str, torch.Tensor]) -> torch.Tensor:
    if not values:
        return torch.zeros(0)
    return torch.stack([values[name].float().reshape(()) for name in sorted(values)])


def metrics_over_ranks(stats: LossStats, strategy: Any, world_size: int) -> dict[str, float]:
    """The metrics of every rank's `stats` together: sums reduced with the strategy, extremes with one MAX
    all-reduce (every rank calls it)."""
    sums = strategy.reduce(stats.sums(), reduce_op="sum")
    maxima = stats.maxima().clone()
    if world_size > 1 and torch.distributed.is_initialized():
        torch.distributed.all_reduce(maxima, op=torch.distributed.ReduceOp.MAX)
    return stats.from_reduced(sums, maxima).metrics()
