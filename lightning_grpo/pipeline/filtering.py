"""The filter stage: whole groups that would train nothing are dropped before planning, each reported once."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..rollout.records import NO_SIGNAL, RolloutSample, without_signal
from .ledger import RolloutProgress
from .metrics import append_metric

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DroppedGroup:
    """The place of a group `SampleFilterQueue` dropped, returned in its stead when drops are not replaced: the
    planner counts it towards the open step's groups, so the step trains the groups that remain instead of waiting
    for more."""

    group_id: int
    reason: str  #: why it was dropped: `stale`, `oversize`, `truncated` or `no_signal`


class SampleFilterQueue:
    """Drops whole groups that would train nothing, reporting each drop to `progress`.

    Checks, in this order, each group once (the first that applies is the reason):

    - `stale`: `model_version() - group version > max_staleness`.
    - `oversize`: a sample has more than `token_budget` tokens (only when `token_budget > 0`).
    - `truncated`: every sample is truncated, under `mask_truncated_completions`. In a partly truncated group the
      truncated samples stay (for scoring) with their `completion_mask` zeroed, so they train nothing.
    - `no_signal`: every sample that still trains has advantage exactly 0 (only with `drop_no_signal_groups`). Groups
      with a pending (NaN) advantage pass through for trainer scoring.

    A dropped group is replaced by the next one (`get` goes on waiting), or with `replace_dropped_groups=False` it
    keeps its place: `get` returns a `DroppedGroup` for it, which `StepPlanner` counts towards the step's groups.
    A group already consumed (a duplicate; never expected) is skipped with a warning, so nothing trains twice.
    Metrics appended to `metrics`: `progress/dropped_<reason>_total`, and for each passed group
    `sample/staleness_mean`, `sample/staleness_max` and `sample/time_in_queue_s` (per sample).

    Args:
        groups: source of whole groups with `get(timeout)`, e.g. `GroupedQueue`.
        progress: the run's `RolloutProgress` (None: drop without accounting).
        model_version: the trainer's current policy version.
        max_staleness: how many versions a group may lag the policy.
        mask_truncated_completions: drop fully truncated groups and mask truncated samples.
        token_budget: the planner's per-row token cap; `<= 0` disables the oversize check.
        drop_no_signal_groups: drop groups without a learning signal (False: they train, as in GRPOTrainer).
        replace_dropped_groups: a dropped group's place goes to the next group (False: `get` returns a
            `DroppedGroup`, and the place stays empty).
        metrics: TRL-style sink, `dict[str, list]`.
    """

    def __init__(
        self,
        groups: Any,
        progress: RolloutProgress | None,
        *,
        model_version: Callable[[], int],
        max_staleness: int,
        mask_truncated_completions: bool,
        token_budget: int,
        drop_no_signal_groups: bool = True,
        replace_dropped_groups: bool = True,
        metrics: dict[str, list] | None = None,
    ) -> None:
        if max_staleness < 0:
            raise ValueError(f"`SampleFilterQueue(max_staleness={max_staleness})` must be at least 0.")
        self.groups = groups
        self.progress = progress
        self.model_version = model_version
        self.max_staleness = max_staleness
        self.mask_truncated_completions = mask_truncated_completions
        self.token_budget = token_budget
        self.drop_no_signal_groups = drop_no_signal_groups
        self.replace_dropped_groups = replace_dropped_groups
        self.metrics = metrics
        #: Groups the rollout loop tagged as without signal (`NO_SIGNAL`) that this filter dropped: pacing counted
        #: them as consumed when they were scored, so the consumed count the trainer reports leaves them out.
        self.dropped_early = 0

    def get(self, timeout: float | None = None) -> list[RolloutSample] | DroppedGroup:
        """The next trainable group, or a dropped group's place when drops are not replaced; raises `queue.Empty`
        after `timeout` seconds, `RolloutStop` when the run ends."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.progress is not None:
            self.progress.check()
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            group = self.groups.get(timeout=remaining)
            screened = self._screen(group)
            if isinstance(screened, DroppedGroup) and self.replace_dropped_groups:
                continue
            if screened is not None:
                return screened

    def _screen(self, group: list[RolloutSample]) -> list[RolloutSample] | DroppedGroup | None:
        """The group if it trains, its `DroppedGroup` if it was dropped, None for a duplicate (skipped)."""
        group_id = group[0].group_id
        if self.progress is not None and group_id in self.progress.consumed:
            log.warning("Skipping group %d: it was already consumed (a duplicate from the rollout loop).", group_id)
            append_metric(self.metrics, "progress/duplicate_total", 1.0)
            return None
        staleness = self.model_version() - min(sample.model_version for sample in group)
        reason = self._drop_reason(group, staleness)
        if group[0].extras.get(NO_SIGNAL):
            if reason is None:  # the loop tags only groups whose advantages are all 0, and only when they drop
                raise RuntimeError(
                    f"Group {group_id} came tagged as without learning signal, but it would train: the rollout loop "
                    "and the trainer disagree on `drop_no_signal_groups`."
                )
            self.dropped_early += 1
        if reason is not None:
            log.info(
                "Dropping group %d (%s): group version %d, policy version %d.",
                group_id,
                reason,
                min(sample.model_version for sample in group),
                self.model_version(),
            )
            append_metric(self.metrics, f"progress/dropped_{reason}_total", 1.0)
            if self.progress is not None:
                self.progress.drop(group_id, reason)
            return DroppedGroup(group_id, reason)
        if self.mask_truncated_completions:
            for sample in group:
                if sample.truncated:
                    sample.completion_mask = np.zeros_like(sample.completion_mask)
        now = time.time()
        append_metric(self.metrics, "sample/staleness_mean", float(staleness))
        append_metric(self.metrics, "sample/staleness_max", float(staleness))
        for sample in group:
            if sample.enqueued_at is not None:
                append_metric(self.metrics, "sample/time_in_queue_s", now - sample.enqueued_at)
        return group

    def _drop_reason(self, group: list[RolloutSample], staleness: int) -> str | None:
        if staleness > self.max_staleness:
            return "stale"
        if self.token_budget > 0 and any(sample.num_tokens > self.token_budget for sample in group):
            return "oversize"
        masked = [self.mask_truncated_completions and sample.truncated for sample in group]
        if all(masked):
            return "truncated"
        advantages = [sample.advantage for sample in group]
        if not self.drop_no_signal_groups or any(math.isnan(a) for a in advantages):
            return None
        if without_signal(sample for sample, m in zip(group, masked, strict=True) if not m):
            return "no_signal"
        return None
