"""The collator: one planned optimizer step packed into one `StepBatch` per rank."""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..options import AdvantageEstimator, ScaleRewards
from ..rollout.advantages import batch_advantages
from ..rollout.records import LEARNING_SIGNAL, RolloutSample
from .batch import MicroBatch, StepBatch, set_step_normalizers
from .ledger import RolloutProgress, RolloutStop
from .stopping import describe_failure

if TYPE_CHECKING:
    from .planner import ScoredRow, StepPlan

log = logging.getLogger(__name__)


class ProgressCollator:
    """TRL's collator, reporting trained groups and passing a stream stop on.

    Turns one `StepPlan` into `num_processes` `StepBatch`es: rank r gets row r of each micro-batch, packed with
    `ScoredRow.pack()` plus the keys documented in `lightning_grpo.pipeline.batch` (`sample_uid`, `sample_group_id`,
    `sample_truncated`, `sample_trained_tokens`, `rollout_rewards`, and the step's loss normalizers
    `step_trained_tokens` and `step_sequences`). Rank 0's batch also carries the step's samples and metrics. A
    `RolloutStop` item becomes `num_processes` stop items carrying it. Reports the step's groups to `progress`: `train`
    for scored groups, `hold` for pending ones. An exception while collating a plan becomes a stop item with the error,
    like `StopAwareDataset` does.

    With `scale_rewards="batch"`, the step is the batch: the scored groups' advantages (group-centred by the rollout
    loop, with their learning signal in `extras[LEARNING_SIGNAL]`) are scaled by one standard deviation over the
    step (`batch_advantages`) before packing, in the micro-batches and in the step's `RolloutSample`s. Pending
    groups are left to `score_step`, which does the same for them.

    Subclasses add keys by overriding `collate_micro_batch` (all rows of one micro-batch) or `collate_row`.

    Args:
        progress: the run's `RolloutProgress` (the planner's).
        num_processes: ranks.
        pad_token_id: for subclasses that pad (scorer inputs); rows themselves are never padded across ranks.
        reward_names: rollout reward columns, read from `sample.metrics["rewards/<name>"]` (NaN when absent).
        scale_rewards: the data module's `scale_rewards`; `"batch"` scales advantages over each step.
        advantage_estimator: the data module's `advantage_estimator` (see `batch_advantages`).
    """

    def __init__(
        self,
        progress: RolloutProgress | None = None,
        *,
        num_processes: int,
        pad_token_id: int = 0,
        reward_names: Sequence[str] = (),
        scale_rewards: ScaleRewards = "group",
        advantage_estimator: AdvantageEstimator = "grpo",
    ) -> None:
        if num_processes < 1:
            raise ValueError(f"`ProgressCollator(num_processes={num_processes})` must be at least 1.")
        self.progress = progress
        self.num_processes = num_processes
        self.pad_token_id = pad_token_id
        self.reward_names = list(reward_names)
        self.scale_rewards = scale_rewards
        self.advantage_estimator = advantage_estimator

    def __call__(self, item: StepPlan | RolloutStop) -> list[StepBatch]:
        if isinstance(item, RolloutStop):
            return [StepBatch(stop=item) for _ in range(self.num_processes)]
        try:
            batches = self._collate(item)
        except Exception as exc:
            log.error("Collating a step failed; stopping every rank.", exc_info=exc)
            stop = RolloutStop(error=describe_failure(exc))
            return [StepBatch(stop=stop) for _ in range(self.num_processes)]
        if self.progress is not None:
            pending = set(item.pending_group_ids)
            self.progress.train([g for g in item.group_ids if g not in pending])
            self.progress.hold([g for g in item.group_ids if g in pending])
        return batches

    def _collate(self, plan: StepPlan) -> list[StepBatch]:
        if self.scale_rewards == "batch":
            self._scale_over_step(plan)
        per_rank: list[list[MicroBatch]] = [[] for _ in range(self.num_processes)]
        for rows in plan.micro_batches:
            if len(rows) != self.num_processes:
                raise ValueError(
                    f"A micro-batch has {len(rows)} rows but `ProgressCollator(num_processes={self.num_processes})`; "
                    "build the StepPlanner and the collator with the same num_processes."
                )
            for rank, micro_batch in enumerate(self.collate_micro_batch(rows)):
                per_rank[rank].append(micro_batch)
        set_step_normalizers([mb for rank in per_rank for mb in rank])
        batches = [
            StepBatch(micro_batches=per_rank[r], group_ids=list(plan.group_ids), reward_names=list(self.reward_names))
            for r in range(self.num_processes)
        ]
        batches[0].samples = list(plan.samples)
        batches[0].metrics = {**plan.metrics, **self.sample_metrics(plan.samples)}
        return batches

    def _scale_over_step(self, plan: StepPlan) -> None:
        """Scale the step's scored groups' advantages by the batch form (see the class doc), in place."""
        pending = set(plan.pending_group_ids)
        groups: dict[int, list[dict]] = defaultdict(list)
        for row in plan.rows:
            for d in row.samples:
                if d["uid"] >= 0 and d["group_id"] not in pending:
                    groups[d["group_id"]].append(d)
        if not groups:
            return
        missing = [
            d["group_id"] for dicts in groups.values() for d in dicts if LEARNING_SIGNAL not in d["sample"].extras
        ]
        if missing:
            raise ValueError(
                f"`scale_rewards='batch'` needs each sample's learning signal in `extras[{LEARNING_SIGNAL!r}]`, which "
                f"the samples of groups {sorted(set(missing))[:10]} lack: a GRPORolloutLoop built with "
                "`scale_rewards='batch'` sets it."
            )
        signals = [np.array([d["sample"].extras[LEARNING_SIGNAL] for d in dicts]) for dicts in groups.values()]
        centred = [np.array([d["advantage"] for d in dicts]) for dicts in groups.values()]
        scaled = batch_advantages(signals, centred, self.advantage_estimator)
        for dicts, advantages in zip(groups.values(), scaled, strict=True):
            for d, advantage in zip(dicts, advantages.tolist(), strict=True):
                d["advantage"] = d["sample"].advantage = advantage

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
