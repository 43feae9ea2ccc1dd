"""The training stream: rank 0's rollout pipeline, and the per-rank dataset that scatters each step to the ranks.

Rank 0 runs GroupedQueue → SampleFilterQueue → StepPlanner → StopAwareDataset → collator, which turns each planned
optimizer step into one `StepBatch` per rank; `StepStream` sends every rank its own (a gloo `scatter_object_list`,
entered the same number of times by every rank) and ends on every rank right after the stop item.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from .batch import StepBatch
from .collating import ProgressCollator
from .filtering import SampleFilterQueue
from .grouping import GroupedQueue
from .ledger import RolloutProgress, RolloutStop
from .planner import StepPlanner
from .stopping import StopAwareDataset

log = logging.getLogger(__name__)


class RolloutPipeline:
    """Rank 0's pipeline from the rollout queue to per-rank step batches; iterate it once.

    Each item is a list of `num_processes` `StepBatch`es (rank r's at index r); the last one is a list of stop items.

    Args:
        worker: the started `GRPORolloutWorker` (its `rollout_buffer`, `check_health`, `groups_consumed`).
        progress: the run's `RolloutProgress`.
        planner_kwargs: `StepPlanner` arguments other than `dataset` and `progress`.
        collator: a `ProgressCollator` (or `ScoringCollator`) built on the same `progress`.
        model_version: the trainer's current policy version, for the staleness check.
        max_staleness: policy versions a group may lag when it trains (`SampleFilterQueue`).
        mask_truncated_completions: drop fully truncated groups, mask truncated samples (`SampleFilterQueue`).
        heartbeat_timeout: seconds without a heartbeat after which the rollout child counts as hung.
        metrics: the sink the pipeline's stages append to.
    """

    def __init__(
        self,
        worker: Any,
        progress: RolloutProgress,
        *,
        planner_kwargs: dict[str, Any],
        collator: ProgressCollator,
        model_version: Callable[[], int],
        max_staleness: int,
        mask_truncated_completions: bool,
        heartbeat_timeout: float,
        metrics: dict[str, list],
    ) -> None:
        self.worker = worker
        self.progress = progress
        self.metrics = metrics
        self._settled_at_start = progress.settled()
        self._heartbeat_timeout = heartbeat_timeout
        groups = GroupedQueue(worker.rollout_buffer, health_check=self._poll)
        filtered = SampleFilterQueue(
            groups,
            progress,
            model_version=model_version,
            max_staleness=max_staleness,
            mask_truncated_completions=mask_truncated_completions,
            token_budget=planner_kwargs.get("token_budget", 0),
            metrics=metrics,
        )
        self.planner = StepPlanner(filtered, progress=progress, metrics=metrics, **planner_kwargs)
        self.collator = collator
        self.wait_s = 0.0

    def _poll(self) -> None:
        """While waiting for rollouts: fail on a dead or hung child, and tell it how far the trainer got (pacing)."""
        self.worker.check_health(self._heartbeat_timeout)
        self.report_consumed()

    def report_consumed(self) -> None:
        """Pacing counts settled groups (trained steps are committed after their weights are pushed), so a group
        admitted now is generated with the newest weights and trains within `max_staleness` versions of them."""
        self.worker.groups_consumed = self.progress.settled() - self._settled_at_start

    def __iter__(self) -> Iterator[list[StepBatch]]:
        items = iter(StopAwareDataset(self.planner))
        while True:
            started = time.monotonic()
            self.report_consumed()  # the previous step trained and its weights were pushed by now
            item = next(items)
            batches = self.collator(item)
            self.wait_s += time.monotonic() - started
            yield batches
            if isinstance(item, RolloutStop) or batches[0].stop:
                return


class StepStream(torch.utils.data.IterableDataset):
    """Every rank's stream of `StepBatch`es: one per optimizer step, then the stop item, then the end.

    On rank 0 it pulls the next step from `source` (a `RolloutPipeline`) and scatters rank r's batch to rank r over
    `group`; the other ranks receive. Every rank therefore fetches the same number of times, and the stop reaches
    all of them at the same batch. It ends right after the stop item (reading on would block Lightning's one-ahead
    prefetch), and calls `on_stop` on every rank, which sets `trainer.should_stop` so a new epoch does not iterate
    again.

    Args:
        source: rank 0's pipeline (None on other ranks).
        rank, world_size: this process's place.
        group: the gloo process group to scatter on (None with one process).
        on_stop: called on every rank when the stop item passes.
        max_batches: `__len__`: an upper bound on the batches (the run's groups + 1).
    """

    def __init__(
        self,
        source: RolloutPipeline | None,
        *,
        rank: int,
        world_size: int,
        group: Any = None,
        on_stop: Callable[[], None] | None = None,
        max_batches: int = 1,
    ) -> None:
        super().__init__()
        if rank == 0 and source is None:
            raise ValueError("`StepStream` on rank 0 needs the rollout pipeline as `source`.")
        self.source = source
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.on_stop = on_stop
        self.max_batches = max_batches
        self._done = False

    def __len__(self) -> int:
        """An upper bound on the batches (every step trains at least one group, then the stop item).

        A known length makes Lightning fetch each batch only after the previous one trained (no one-ahead prefetch),
        so a step is planned against the policy version it trains with, and pacing (see `RolloutPipeline`) keeps
        every group within `max_staleness` of it.
        """
        return self.max_batches

    def __iter__(self) -> Iterator[StepBatch]:
        if self._done:
            return
        steps = iter(self.source) if self.rank == 0 else None
        while True:
            batch = self._next(steps)
            yield batch
            if batch.stop:
                self._done = True
                if self.on_stop is not None:
                    self.on_stop()
                return

    def _next(self, steps: Iterator[list[StepBatch]] | None) -> StepBatch:
        batches = None
        if steps is not None:
            try:
                batches = next(steps)
            except StopIteration:
                batches = [StepBatch.stop_item("The rollout pipeline ended without a stop item.")] * self.world_size
        if self.world_size == 1:
            return batches[0]
        received: list[Any] = [None]
        dist.scatter_object_list(received, batches if self.rank == 0 else None, src=0, group=self.group)
        return received[0]
