"""The training stream: rank 0's rollout pipeline, and the per-rank dataset that scatters each step to the ranks.

Rank 0 runs GroupedQueue → SampleFilterQueue → StepPlanner → StopAwareDataset → collator, which turns each planned
optimizer step into one `StepBatch` per rank; `StepStream` sends every rank its own and ends on every rank at the
stop item, which it keeps for `RolloutStopCallback` instead of handing it to training.
"""

from __future__ import annotations

import contextlib
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
from .metrics import reduce_metric
from .planner import StepPlanner
from .stopping import StopAwareDataset

log = logging.getLogger(__name__)


#: Metrics the filter stage appends for the groups it passes; they describe the step being planned, so they travel in
#: that step's `StepBatch.metrics` (logged when it trains) instead of the rollout metrics window.
STEP_GAUGES = ("sample/staleness_mean", "sample/staleness_max", "sample/time_in_queue_s")


class RolloutPreempted(BaseException):  # noqa: N818 - like KeyboardInterrupt, it is a request, not an error
    """Raised on rank 0 while it waits for rollouts once `RolloutPipeline.interrupted` says the trainer must stop.

    A `BaseException`, so the planner and `StopAwareDataset` do not turn it into a partial step or an error stop;
    `StepStream` sends every rank a stop item with `preempted=True` instead.
    """


class RolloutPipeline:
    """Rank 0's pipeline from the rollout queue to per-rank step batches; iterate it once.

    Each item is a list of `num_processes` `StepBatch`es (rank r's at index r); the last one is a list of stop items.
    Rank 0's batch of each step carries, besides the planner's and collator's metrics, the staleness and queue time
    of the groups the filter passed while it was planned and `perf/rollout_wait_s` (how long the trainer waited for
    it).

    Args:
        worker: the started `GRPORolloutWorker` (its `rollout_buffer`, `check_health`, `groups_consumed`).
        progress: the run's `RolloutProgress`.
        planner_kwargs: `StepPlanner` arguments other than `dataset` and `progress`.
        collator: a `ProgressCollator` (or `ScoringCollator`) built on the same `progress`.
        model_version: the trainer's current policy version, for the staleness check.
        max_staleness: policy versions a group may lag when it trains (`SampleFilterQueue`).
        mask_truncated_completions: drop fully truncated groups, mask truncated samples (`SampleFilterQueue`).
        heartbeat_timeout: seconds without a heartbeat after which the rollout child counts as hung.
        drop_no_signal_groups: drop groups whose advantages are all 0 (`SampleFilterQueue`).
        replace_dropped_groups: a dropped group's place in the step goes to the next group (False: it stays empty).
        metrics: the sink the pipeline's stages append to.
        core_sharing: a `CoreSharing` to tell the generator while the trainer waits for rollouts, or None.
        interrupted: polled (about once a second) while the trainer waits for rollouts; when it returns True the wait
            ends with `RolloutPreempted` (the trainer received SIGTERM), so a preemption never waits for generation.
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
        drop_no_signal_groups: bool = True,
        replace_dropped_groups: bool = True,
        metrics: dict[str, list],
        core_sharing: Any = None,
        interrupted: Callable[[], bool] | None = None,
    ) -> None:
        self.worker = worker
        self.interrupted = interrupted
        self.progress = progress
        self.metrics = metrics
        self._final_at_start = progress.final_group_count()
        self._heartbeat_timeout = heartbeat_timeout
        groups = GroupedQueue(worker.rollout_buffer, health_check=self._poll)
        filtered = SampleFilterQueue(
            groups,
            progress,
            model_version=model_version,
            max_staleness=max_staleness,
            mask_truncated_completions=mask_truncated_completions,
            token_budget=planner_kwargs.get("token_budget", 0),
            drop_no_signal_groups=drop_no_signal_groups,
            replace_dropped_groups=replace_dropped_groups,
            metrics=metrics,
        )
        self._filtered = filtered
        self.planner = StepPlanner(filtered, progress=progress, metrics=metrics, **planner_kwargs)
        self.collator = collator
        self._core_sharing = core_sharing

    def _poll(self) -> None:
        """While waiting for rollouts: fail on a dead or hung child, and tell it how far the trainer got (pacing)."""
        if self.interrupted is not None and self.interrupted():
            raise RolloutPreempted()
        self.worker.check_health(self._heartbeat_timeout)
        self.report_consumed()

    def report_consumed(self) -> None:
        """Pacing counts groups whose fate is final (trained steps are committed after their weights are pushed), so a
        group admitted now is generated with the newest weights and trains within `max_staleness` versions of them.
        Groups the loop dropped early are left out: it counted them itself when it scored them (see `Pacing`)."""
        final = self.progress.final_group_count() - self._final_at_start
        self.worker.groups_consumed = final - self._filtered.dropped_early

    def _step_gauges(self, waited_s: float) -> dict[str, float]:
        gauges = {key: reduce_metric(key, self.metrics.pop(key)) for key in STEP_GAUGES if self.metrics.get(key)}
        return {**gauges, "perf/rollout_wait_s": waited_s}

    def _waiting(self) -> contextlib.AbstractContextManager:
        """While the trainer waits for the next step's rollouts, its cores are the generator's (`CoreSharing`)."""
        return self._core_sharing.trainer_waiting() if self._core_sharing is not None else contextlib.nullcontext()

    def __iter__(self) -> Iterator[list[StepBatch]]:
        items = iter(StopAwareDataset(self.planner))
        while True:
            started = time.monotonic()
            self.report_consumed()  # the previous step trained and its weights were pushed by now
            with self._waiting():
                item = next(items)
            batches = self.collator(item)
            if batches[0].stop is None:
                batches[0].metrics.update(self._step_gauges(waited_s=time.monotonic() - started))
            yield batches
            if isinstance(item, RolloutStop) or batches[0].stop is not None:
                return


class StepStream(torch.utils.data.IterableDataset):
    """Every rank's stream of `StepBatch`es, one per optimizer step, ended on every rank at the same batch.

    On rank 0 it pulls the next step from `source` (a `RolloutPipeline`) and scatters rank r's batch to rank r over
    `group` (a gloo `scatter_object_list`); the other ranks receive. Every rank therefore fetches the same number of
    times, and the stop item that ends the rollout stream reaches all of them at the same batch. The stop item never
    leaves the stream: its `RolloutStop` is kept as `stop`, and the iterator ends.

    `look_ahead()` fetches the next step as soon as the previous one trained (`RolloutStopCallback` calls it after
    the weight push), and holds it for the next `__next__`. So the run's end is known at the end of its last step,
    where `trainer.should_stop` lets Lightning run its end-of-fit validation, instead of at a fetch that no hook sees.

    Args:
        source: rank 0's pipeline (None on other ranks).
        rank, world_size: this process's place.
        group: the gloo process group to scatter on (None with one process).
        max_batches: `__len__`: an upper bound on the batches (the run's groups).

    Raises:
        ValueError: rank 0 without a `source`.
    """

    def __init__(
        self,
        source: RolloutPipeline | None,
        *,
        rank: int,
        world_size: int,
        group: Any = None,
        max_batches: int = 1,
    ) -> None:
        super().__init__()
        if rank == 0 and source is None:
            raise ValueError("`StepStream` on rank 0 needs the rollout pipeline as `source`.")
        self.source = source
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.max_batches = max_batches
        self.stop: RolloutStop | None = None
        self._held: StepBatch | None = None
        self._steps: Iterator[list[StepBatch]] | None = None

    def __len__(self) -> int:
        """An upper bound on the batches (every step trains at least one group).

        A known length makes Lightning fetch each batch only when it is about to train it (no one-ahead prefetch),
        so a step is planned against the weights it trains after, and pacing (see `RolloutPipeline`) keeps every
        group within `max_staleness` of them.
        """
        return self.max_batches

    def look_ahead(self) -> RolloutStop | None:
        """Every rank: fetch the next step now and hold it for the next `__next__`; returns the stream's stop if it
        ended there (None while it goes on)."""
        if self.stop is None and self._held is None:
            batch = self._fetch()
            if batch.stop is not None:
                self.stop = batch.stop
            else:
                self._held = batch
        return self.stop

    def __iter__(self) -> Iterator[StepBatch]:
        if self.stop is not None and self._held is None:
            raise RuntimeError(
                "The rollout stream already ended with its stop item, but training asked for more batches: keep "
                "`RolloutStopCallback` (GRPOModule adds it), which stops the fit there, and leave `min_epochs` and "
                "`min_steps` unset (the data module ends the run)."
            )
        while True:
            self.look_ahead()
            if self._held is None:
                return
            batch, self._held = self._held, None
            yield batch

    def _fetch(self) -> StepBatch:
        batches = None
        if self.rank == 0 and self.source is not None:  # rank 0 has one (checked at construction)
            if self._steps is None:
                self._steps = iter(self.source)
            try:
                batches = next(self._steps)
            except StopIteration:
                ended = RolloutStop(error="The rollout pipeline ended without a stop item.")
                batches = [StepBatch(stop=ended)] * self.world_size
            except RolloutPreempted:
                batches = [StepBatch(stop=RolloutStop(preempted=True))] * self.world_size
        if self.world_size == 1 and batches is not None:  # rank 0 alone
            return batches[0]
        received: list[Any] = [None]
        dist.scatter_object_list(received, batches if self.rank == 0 else None, src=0, group=self.group)
        return received[0]
