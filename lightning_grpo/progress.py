"""Progress accounting and termination of the rollout stream, so that a run always ends and resumes exactly once.

TRL ends an epoch-bounded run only when an optimizer step ends, so a run whose remaining rollouts are all dropped
(no reward signal, truncated, too stale, too long) would generate forever. Here `SampleFilterQueue` drops groups that
would train nothing and reports each drop to `RolloutProgress`, which owns the set of consumed group ids (trained or
dropped) that the epoch bound and resume read. When every group of the run is consumed, or `stall_groups` groups in a
row were consumed without one training, the rank-0 pipeline raises `RolloutStop`; `StopAwareDataset` turns it into one
last item and `ProgressCollator` into one stop `StepBatch` per rank, so all ranks end (or raise the stall error) at
the same batch.

Rank 0 only, single-threaded: the DataLoader (`num_workers=0`) and the callbacks run on the main thread.
"""

from __future__ import annotations

import logging
import math
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .batch import MicroBatch, StepBatch
from .records import RolloutSample

if TYPE_CHECKING:
    from .planner import ScoredRow, StepPlan

log = logging.getLogger(__name__)

#: Why `SampleFilterQueue` drops a group, and the knob that changes it (quoted in the stall error).
DROP_HINTS = {
    "no_signal": "every sample of a group got the same reward: check the reward functions, or raise "
    "num_generations or the sampling temperature",
    "stale": "groups arrived more than max_staleness versions behind the policy: raise max_staleness, or generate "
    "less far ahead (lower max_inflight_tasks)",
    "truncated": "every completion hit the length limit: raise max_completion_length, or set "
    "mask_truncated_completions=False",
    "oversize": "a sample (or a group) does not fit the planner's budget: raise token_budget or steps",
}


def append_metric(metrics: dict[str, list] | None, key: str, value: float) -> None:
    """Append `value` under `key` of a TRL-style metric sink (a plain dict or a defaultdict of lists)."""
    if metrics is not None:
        metrics.setdefault(key, []).append(value)


class RolloutStop(Exception):  # noqa: N818 - the seed's name
    """Ends the rollout stream; `error` is set when the run made no progress or rank 0's pipeline failed.

    `error` is text, so the stop pickles and crosses processes (every rank receives it as a `StepBatch.stop_item`).
    """

    def __init__(self, error: str | None = None) -> None:
        super().__init__(error)
        self.error = error

    def __repr__(self) -> str:
        return f"RolloutStop(error={self.error!r})"


class RolloutProgress:
    """Consumed and trained prompt groups, and the stream's stop conditions.

    A group is *consumed* once it trained or its rollouts were dropped. A group moves through these states:

    - `hold(ids)`: collated with advantages pending (trainer scoring). Counted consumed for the end-of-run check, but
      neither resets nor extends a stall; `score_step` later reports it with `train` or `exclude`.
    - `train(ids)`: collated into a step that trains it. Resets the stall run. Not yet in `state_dict()`.
    - `commit(ids)`: the optimizer step that trained it is done. Lightning collates batch k+1 before batch k trains
      and before a checkpoint at step k is saved, so only committed groups are checkpointed as trained; collated but
      uncommitted ones are regenerated on resume.
    - `drop(id, reason)` / `exclude(id, reason)`: consumed without training (final at once, checkpointed). Each
      extends the stall run and counts under its reason.

    The stream ends with `RolloutStop()` once `epochs_done` group ids are consumed, and with `RolloutStop(error=...)`
    once `stall_groups` groups in a row were consumed without one training (the stall wins when both hold).

    Args:
        consumed: group ids consumed before this run (a `set` is updated in place, so a caller may share it).
        epochs_done: the number of groups in the run, `len(GroupSchedule)`: the epochs are done once that many
            distinct ids (all in `range(epochs_done)`) are consumed.
        stall_groups: how many groups in a row may be consumed without one training; callers default it to one
            pass over the prompts.

    Raises:
        ValueError: on non-positive `epochs_done` or `stall_groups`, or ids outside `range(epochs_done)`.

    Example::

        progress = RolloutProgress(epochs_done=len(schedule), stall_groups=schedule.num_prompts)
        progress.load_state_dict(checkpoint_state)  # on resume
        child_ids = schedule.group_ids(skip=set(progress.consumed))
    """

    def __init__(self, consumed: Iterable[int] = (), *, epochs_done: int, stall_groups: int) -> None:
        if epochs_done < 1 or stall_groups < 1:
            raise ValueError(
                f"`RolloutProgress(epochs_done={epochs_done}, stall_groups={stall_groups})`: both must be at least 1 "
                "(epochs_done is the run's number of groups, len(GroupSchedule))."
            )
        self.epochs_done = epochs_done
        self.stall_groups = stall_groups
        self.consumed: set[int] = consumed if isinstance(consumed, set) else set(consumed)
        self._check_ids(self.consumed, "consumed")
        self.dropped: Counter[str] = Counter()  # drops per reason, over the whole run
        self.excluded: Counter[str] = Counter()  # exclusions per reason, over the whole run
        self.trained_total = 0  # committed trained groups, over the whole run
        self._uncommitted: set[int] = set()
        self._held: set[int] = set()
        self._stall_run = 0
        self._stall_reasons: Counter[str] = Counter()

    def outstanding(self) -> int:
        """Groups of the run not consumed yet (some may sit in the planner's open step)."""
        return self.epochs_done - len(self.consumed)

    def settled(self) -> int:
        """Groups whose fate is final: trained and committed, dropped or excluded. Generation is paced on it."""
        return len(self.consumed) - len(self._uncommitted) - len(self._held)

    @property
    def stall_run(self) -> int:
        """Groups consumed in a row without one training."""
        return self._stall_run

    def train(self, group_ids: Iterable[int]) -> None:
        """Record groups that trained (collated into a step); resets the stall run. Commit them after the step."""
        new = self._claim(group_ids, "train")
        for group_id in new:
            self._held.discard(group_id)
            self._uncommitted.add(group_id)
        if new:
            self._stall_run = 0
            self._stall_reasons.clear()

    def hold(self, group_ids: Iterable[int]) -> None:
        """Record collated groups whose advantages are pending; `train` or `exclude` resolves each later."""
        for group_id in self._claim(group_ids, "hold", allow_held=False):
            self._held.add(group_id)

    def commit(self, group_ids: Iterable[int]) -> None:
        """Mark trained groups as final once the optimizer step that trained them is done (rank 0).

        Ids already final (dropped, excluded, committed) are ignored.

        Raises:
            ValueError: for an id never collated, or one still held (score_step did not report it).
        """
        group_ids = list(group_ids)
        held = [g for g in group_ids if g in self._held]
        unknown = [g for g in group_ids if g not in self.consumed]
        problems = []
        if held:
            problems.append(
                f"groups {held} are held for trainer scoring (score_step must report each with train() or exclude() first)"
            )
        if unknown:
            problems.append(f"groups {unknown} were never collated")
        if problems:
            raise ValueError(f"`RolloutProgress.commit({group_ids})`: {'; '.join(problems)}.")
        for group_id in group_ids:
            if group_id in self._uncommitted:
                self._uncommitted.remove(group_id)
                self.trained_total += 1

    def drop(self, group_id: int, reason: str) -> None:
        """Count `group_id` as consumed without training; may end the stream (raises `RolloutStop`)."""
        if self._consume_untrained(group_id, reason, self.dropped, "drop"):
            self.check()

    def exclude(self, group_id: int, reason: str = "masked") -> None:
        """Count a collated group whose every sample scoring took out of the loss.

        Runs outside the stream (in `score_step`), so it never raises `RolloutStop`: a stall it completes is raised
        by the stream's next `check`, or after the run's last step by `stall_error`.
        """
        self._check_ids([group_id], "exclude")
        if group_id in self._held or group_id in self._uncommitted:
            self._held.discard(group_id)
            self._uncommitted.discard(group_id)
            self.consumed.discard(group_id)  # consumed again below, as excluded
        self._consume_untrained(group_id, reason, self.excluded, "exclude")

    def check(self) -> None:
        """End the stream when a full pass over the prompts trained no group, or when every group is consumed.

        Raises:
            RolloutStop: with `error` on a stall, without when the run's groups are all consumed.
        """
        error = self.stall_error()
        if error is not None:
            raise RolloutStop(error=error)
        if len(self.consumed) >= self.epochs_done:
            raise RolloutStop()

    def stall_error(self) -> str | None:
        """The stall error when `stall_groups` groups in a row were consumed without one training, else None.

        Call it on rank 0 when a clean stop item arrives, and raise the error on every rank if there is one: the
        stream ends as soon as the last step is collated (held groups count as consumed), before `score_step` can
        exclude that step's groups, so a stall those exclusions complete is only visible here.
        """
        return self._stall_message() if self._stall_run >= self.stall_groups else None

    def state_dict(self) -> dict[str, Any]:
        """What a resume needs, as plain ints, lists and dicts (Lightning loads checkpoints with weights_only=True).

        Consumed ids are the final ones (committed, dropped, excluded), stored as `frontier` (the smallest id not
        consumed) plus the sorted ids above it.
        """
        final = self.consumed - self._uncommitted - self._held
        frontier = 0
        while frontier in final:
            frontier += 1
        return {
            "frontier": frontier,
            "consumed_above": sorted(g for g in final if g > frontier),
            "dropped": dict(self.dropped),
            "excluded": dict(self.excluded),
            "trained_total": self.trained_total,
            "stall_run": self._stall_run,
            "stall_reasons": dict(self._stall_reasons),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`'s output; ids at or past `epochs_done` (a run made shorter) are left out."""
        ids = set(range(min(int(state.get("frontier", 0)), self.epochs_done)))
        ids.update(int(g) for g in state.get("consumed_above", ()) if 0 <= int(g) < self.epochs_done)
        self.consumed.clear()
        self.consumed.update(ids)
        self.dropped = Counter(state.get("dropped", {}))
        self.excluded = Counter(state.get("excluded", {}))
        self.trained_total = int(state.get("trained_total", 0))
        self._stall_run = int(state.get("stall_run", 0))
        self._stall_reasons = Counter(state.get("stall_reasons", {}))
        self._uncommitted.clear()
        self._held.clear()

    def _check_ids(self, group_ids: Iterable[int], verb: str) -> None:
        bad = [g for g in group_ids if not 0 <= g < self.epochs_done]
        if bad:
            raise ValueError(
                f"`RolloutProgress.{verb}`: group ids {bad[:10]} are outside the run's range(epochs_done="
                f"{self.epochs_done}). Set epochs_done to len(GroupSchedule) of the schedule that made them."
            )

    def _claim(self, group_ids: Iterable[int], verb: str, allow_held: bool = True) -> list[int]:
        """Consume the ids not consumed yet (and held ones when `allow_held`); warn about the others."""
        group_ids = list(group_ids)
        self._check_ids(group_ids, verb)
        new, seen = [], []
        for group_id in dict.fromkeys(group_ids):
            if group_id not in self.consumed or (allow_held and group_id in self._held):
                new.append(group_id)
                self.consumed.add(group_id)
            else:
                seen.append(group_id)
        if seen:
            log.warning("RolloutProgress.%s: groups %s were already consumed; ignoring them.", verb, seen[:10])
        return new

    def _consume_untrained(self, group_id: int, reason: str, counter: Counter[str], verb: str) -> bool:
        self._check_ids([group_id], verb)
        if group_id in self.consumed:
            log.warning("RolloutProgress.%s: group %d was already consumed; ignoring it.", verb, group_id)
            return False
        self.consumed.add(group_id)
        counter[reason] += 1
        self._stall_run += 1
        self._stall_reasons[reason] += 1
        return True

    def _stall_message(self) -> str:
        reasons = ", ".join(f"{reason}: {count}" for reason, count in self._stall_reasons.most_common())
        hints = "; ".join(f"{r}: {DROP_HINTS[r]}" for r, _ in self._stall_reasons.most_common() if r in DROP_HINTS)
        return (
            f"RolloutProgress(stall_groups={self.stall_groups}): {self._stall_run} prompt groups in a row were "
            f"consumed without one training ({reasons}), so the run stopped instead of generating forever. "
            f"HINT: {hints or 'check the trainer scorers, which excluded every sample'}. Raise stall_groups to "
            "tolerate longer stretches without training."
        )


class SampleFilterQueue:
    """Drops whole groups that would train nothing, reporting each drop to `progress`.

    Checks, in this order, each group once (the first that applies is the reason):

    - `stale`: `model_version() - group version > max_staleness`.
    - `oversize`: a sample has more than `token_budget` tokens (only when `token_budget > 0`).
    - `truncated`: every sample is truncated, under `mask_truncated_completions`. In a partly truncated group the
      truncated samples stay (for scoring) with their `completion_mask` zeroed, so they train nothing.
    - `no_signal`: every sample that still trains has advantage exactly 0. Groups with a pending (NaN) advantage pass
      through for trainer scoring.

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
        self.metrics = metrics

    def get(self, timeout: float | None = None) -> list[RolloutSample]:
        """The next trainable group; raises `queue.Empty` after `timeout` seconds, `RolloutStop` when the run ends."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.progress is not None:
            self.progress.check()
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            group = self.groups.get(timeout=remaining)
            if self._keep(group):
                return group

    def _keep(self, group: list[RolloutSample]) -> bool:
        group_id = group[0].group_id
        if self.progress is not None and group_id in self.progress.consumed:
            log.warning("Skipping group %d: it was already consumed (a duplicate from the rollout loop).", group_id)
            append_metric(self.metrics, "progress/duplicate_total", 1.0)
            return False
        staleness = self.model_version() - min(sample.model_version for sample in group)
        reason = self._drop_reason(group, staleness)
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
            return False
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
        return True

    def _drop_reason(self, group: list[RolloutSample], staleness: int) -> str | None:
        if staleness > self.max_staleness:
            return "stale"
        if self.token_budget > 0 and any(sample.num_tokens > self.token_budget for sample in group):
            return "oversize"
        masked = [self.mask_truncated_completions and sample.truncated for sample in group]
        if all(masked):
            return "truncated"
        advantages = [sample.advantage for sample in group]
        if any(math.isnan(a) for a in advantages):
            return None
        if all(a == 0.0 for a, m in zip(advantages, masked, strict=True) if not m):
            return "no_signal"
        return None


class StopAwareDataset(torch.utils.data.IterableDataset):
    """A rollout batcher whose stream ends with the `RolloutStop` it raised.

    Iterates `batcher` (the `StepPlanner`) and yields its step plans; when it raises `RolloutStop`, yields that stop as
    the last item and ends at once (reading on would block Lightning's one-ahead prefetch). Any other exception (the
    rollout child died, a scorer failed) is logged and becomes `RolloutStop(error=<type, message and traceback>)`, so
    every rank learns it instead of hanging in a collective; a batcher that simply runs out ends with `RolloutStop()`.
    Iterating again after the stop yields the same stop item once more (Lightning re-iterates at a new epoch).

    Use it with `DataLoader(dataset, batch_size=None, num_workers=0, collate_fn=ProgressCollator(...))` on rank 0.
    """

    def __init__(self, batcher: Iterable[Any]) -> None:
        super().__init__()
        self.batcher = batcher
        self.stop: RolloutStop | None = None

    def __iter__(self) -> Iterator[Any]:
        if self.stop is None:
            try:
                yield from self.batcher
                self.stop = RolloutStop()
            except RolloutStop as stop:
                self.stop = stop
            except Exception as exc:
                log.error("Rank 0's rollout pipeline failed; stopping every rank.", exc_info=exc)
                self.stop = RolloutStop(error=_describe(exc))
        yield self.stop


def _describe(exc: BaseException) -> str:
    trace = "".join(traceback.format_exception(exc))
    return f"Rank 0's rollout pipeline failed with {type(exc).__name__}: {exc}\n\nTraceback on rank 0:\n{trace}"


class ProgressCollator:
    """TRL's collator, reporting trained groups and passing a stream stop on.

    Turns one `StepPlan` into `num_processes` `StepBatch`es: rank r gets row r of each micro-batch, packed with
    `ScoredRow.pack()` plus the keys documented in `lightning_grpo.batch` (`sample_uid`, `sample_group_id`,
    `sample_truncated`, `sample_trained_tokens`, `rollout_rewards`, `step_trained_tokens`). Rank 0's batch also
    carries the step's samples and metrics. A `RolloutStop` item becomes `num_processes` stop items. Reports the
    step's groups to `progress`: `train` for scored groups, `hold` for pending ones. An exception while collating a
    plan becomes a stop item with the error, like `StopAwareDataset` does.

    Subclasses add keys by overriding `collate_micro_batch` (all rows of one micro-batch) or `collate_row`.

    Args:
        progress: the run's `RolloutProgress` (the planner's).
        num_processes: ranks.
        pad_token_id: for subclasses that pad (scorer inputs); rows themselves are never padded across ranks.
        reward_names: rollout reward columns, read from `sample.metrics["rewards/<name>"]` (NaN when absent).
    """

    def __init__(
        self,
        progress: RolloutProgress | None = None,
        *,
        num_processes: int,
        pad_token_id: int = 0,
        reward_names: Sequence[str] = (),
    ) -> None:
        if num_processes < 1:
            raise ValueError(f"`ProgressCollator(num_processes={num_processes})` must be at least 1.")
        self.progress = progress
        self.num_processes = num_processes
        self.pad_token_id = pad_token_id
        self.reward_names = list(reward_names)

    def __call__(self, item: StepPlan | RolloutStop) -> list[StepBatch]:
        if isinstance(item, RolloutStop):
            return [StepBatch.stop_item(item.error) for _ in range(self.num_processes)]
        try:
            batches = self._collate(item)
        except Exception as exc:
            log.error("Collating a step failed; stopping every rank.", exc_info=exc)
            return [StepBatch.stop_item(_describe(exc)) for _ in range(self.num_processes)]
        if self.progress is not None:
            pending = set(item.pending_group_ids)
            self.progress.train([g for g in item.group_ids if g not in pending])
            self.progress.hold([g for g in item.group_ids if g in pending])
        return batches

    def _collate(self, plan: StepPlan) -> list[StepBatch]:
        per_rank: list[list[MicroBatch]] = [[] for _ in range(self.num_processes)]
        for rows in plan.micro_batches:
            if len(rows) != self.num_processes:
                raise ValueError(
                    f"A micro-batch has {len(rows)} rows but `ProgressCollator(num_processes={self.num_processes})`; "
                    "build the StepPlanner and the collator with the same num_processes."
                )
            for rank, micro_batch in enumerate(self.collate_micro_batch(rows)):
                per_rank[rank].append(micro_batch)
        total = float(sum(mb["token_index"].numel() for rank in per_rank for mb in rank))
        for micro_batch in (mb for rank in per_rank for mb in rank):
            micro_batch["step_trained_tokens"] = torch.tensor(total, dtype=torch.float32)
        batches = [
            StepBatch(micro_batches=per_rank[r], group_ids=list(plan.group_ids), reward_names=list(self.reward_names))
            for r in range(self.num_processes)
        ]
        batches[0].samples = list(plan.samples)
        batches[0].metrics = {**plan.metrics, **self.sample_metrics(plan.samples)}
        return batches

    def collate_micro_batch(self, rows: list[ScoredRow]) -> list[MicroBatch]:
        """One packed dict per rank for one micro-batch (`rows[r]` is rank r's)."""
        return [self.collate_row(row) for row in rows]

    def collate_row(self, row: ScoredRow) -> MicroBatch:
        """`row.pack()` plus the per-sample keys, aligned with `segment_id` (the row's sample order)."""
        batch = row.pack()
        samples = row.samples
        batch["sample_uid"] = torch.tensor([d["uid"] for d in samples], dtype=torch.int64)
        batch["sample_group_id"] = torch.tensor([d["group_id"] for d in samples], dtype=torch.int64)
        batch["sample_truncated"] = torch.tensor([bool(d["truncated"]) for d in samples], dtype=torch.bool)
        # NaN while trainer scoring is pending; score_step reads it for samples that have no loss term
        batch["sample_advantage"] = torch.tensor([float(d["advantage"]) for d in samples], dtype=torch.float32)
        # a token trains off its predecessor, so the first token never does (as in `TreeRow.pack`)
        trained = [int(np.asarray(d["completion_mask"])[1:].sum()) for d in samples]
        batch["sample_trained_tokens"] = torch.tensor(trained, dtype=torch.int64)
        rewards = [self.rollout_rewards(d["sample"]) for d in samples]
        batch["rollout_rewards"] = torch.tensor(rewards, dtype=torch.float32).reshape(
            len(samples), len(self.reward_names)
        )
        return batch

    def rollout_rewards(self, sample: RolloutSample | None) -> list[float]:
        """The rollout-side reward columns of one sample, NaN where not scored (all NaN for a filler)."""
        if sample is None:
            return [math.nan] * len(self.reward_names)
        return [float(sample.metrics.get(f"rewards/{name}", math.nan)) for name in self.reward_names]

    @staticmethod
    def sample_metrics(samples: list[RolloutSample]) -> dict[str, float]:
        """Token counts and NaN-aware means of the samples' numeric metrics (rewards), as TRL's collator logs."""
        if not samples:
            return {}
        forwarded = [sample.num_tokens for sample in samples]
        trained = [sample.num_trained_tokens for sample in samples]
        metrics = {
            "sample/forwarded_tokens_mean": sum(forwarded) / len(forwarded),
            "sample/forwarded_tokens_max": float(max(forwarded)),
            "sample/trained_tokens_mean": sum(trained) / len(trained),
            "batch/masked_token_frac": (sum(forwarded) - sum(trained)) / max(sum(forwarded), 1),
        }
        keys = dict.fromkeys(key for sample in samples for key in sample.metrics)
        for key in keys:
            values = [sample.metrics[key] for sample in samples if isinstance(sample.metrics.get(key), int | float)]
            valid = [float(v) for v in values if not math.isnan(v)]
            if values:
                metrics[key] = sum(valid) / len(valid) if valid else math.nan
        return metrics
