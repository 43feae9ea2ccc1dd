"""Scoring rollouts on the trainer: rewards that need the trainer's device (reward models, EBFT feature networks).

With trainer scorers the rollout child scores only its own reward columns and leaves each sample's advantage NaN
(pending). The planner keeps every group inside one optimizer step, and `score_step`, called on every rank before
the step trains, runs each scorer's forward on the rank's micro-batches, all-gathers the features, computes the
groups' rewards and advantages and writes them into the micro-batches. Samples that carry no gradient (zero
advantage under `drop_no_signal_groups`, or truncated under `mask_truncated_completions`) are taken out of the loss
and of its normalizer, which is what dropping them before packing would have done.

A scorer's life in one step (see `TrainerScorer`): `group_extras` (rank 0, planning) -> `collate` (rank 0, packing;
its inputs travel in each micro-batch under `s{index}_` keys) -> `features` (every rank, every chunk) ->
`group_rewards` (every rank, on the gathered features).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from ..pipeline.batch import MicroBatch, StepBatch, write_step_normalizers
from ..rollout.advantages import (
    AdvantageEstimator,
    Aggregation,
    ScaleRewards,
    batch_advantages,
    compute_group_advantages,
    learning_signal,
)
from .packing import chunk_inputs
from .trainer_scorer import FILLER_UID, TrainerScorer, decode_extra_uid

if TYPE_CHECKING:
    from ..contract import RolloutContract
    from ..pipeline.ledger import RolloutProgress


@dataclass(slots=True)
class ScoredStep:
    """What `score_step` computed for the step's pending groups, for logging and for callers that look at the scores.

    Attributes:
        reward_names: the columns: the rollout's (`StepBatch.reward_names`), then one per scorer.
        uids: `(U,)` the scored samples' `sample_uid`s, ascending (index `StepBatch.samples` on rank 0).
        rewards: `(U, C)` each sample's reward columns; NaN = not scored.
        advantages: `(U,)` each sample's advantage.
        trained: `(U,)` whether the sample stayed in the loss.
        group_ids: the scored groups; `excluded_group_ids` those of them that train nothing.
        metrics: `scoring/*` counts and `rewards/<scorer>` means.
    """

    reward_names: list[str]
    uids: np.ndarray
    rewards: np.ndarray
    advantages: np.ndarray
    trained: np.ndarray
    group_ids: list[int] = field(default_factory=list)
    excluded_group_ids: list[int] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


def score_step(
    module: torch.nn.Module,
    step: StepBatch,
    *,
    scorers: Sequence[TrainerScorer],
    reward_weights: Sequence[float] | None = None,
    aggregation: Aggregation = "sum_then_normalize",
    scale_rewards: ScaleRewards = "group",
    mask_truncated_completions: bool = False,
    progress: RolloutProgress | None = None,
    group: dist.ProcessGroup | None = None,
    advantage_estimator: AdvantageEstimator = "grpo",
    drop_no_signal_groups: bool = True,
) -> ScoredStep | None:
    """Score one optimizer step's micro-batches in place (see the module doc); call it on every rank.

    Runs every scorer's `features` on this rank's micro-batches (one call per chunk), all-gathers uids, features and
    per-sample data once, and for each pending group (advantage NaN) computes the scorers' columns, merges them with
    the rollout columns and calls `compute_group_advantages`. Groups whose advantages are known pass through
    untouched. In pending groups, a sample whose advantage is exactly 0 (under `drop_no_signal_groups`), or that is
    truncated under `mask_truncated_completions`, is taken out of the loss: its terms are removed from `token_index`,
    `old_log_probs`, `advantages` and `segment_id`, and every micro-batch's `step_trained_tokens` and
    `step_sequences` become the step's remaining term and sample counts. On rank 0, `progress.train` gets the scored
    groups that train and `progress.exclude` those that do not (reason `"no_signal"`, or `"truncated"` when
    truncation masked samples that had a signal).

    `scale_rewards="batch"` divides by one standard deviation over the step's pending groups (`batch_advantages`).

    Args:
        module: passed to `scorer.features` (its device is where forwards run).
        step: this rank's `StepBatch`; its micro-batches are changed in place.
        scorers: the trainer scorers, in `s{index}_` order. With none, nothing happens and None is returned.
        reward_weights: one weight per column: the rollout columns (`step.reward_names`), then the scorers.
        aggregation, scale_rewards: as in `compute_group_advantages`.
        advantage_estimator: the baseline (`compute_group_advantages`' `estimator`).
        mask_truncated_completions: also take truncated samples of scored groups out of the loss.
        drop_no_signal_groups: take samples whose advantage is exactly 0 out of the loss (False: they train, counted
            in the normaliser, as in GRPOTrainer).
        progress: rank 0's `RolloutProgress` (ignored on other ranks).
        group: process group for the all-gather (default: the default group; a gloo side group keeps pickled
            objects off NCCL). Without torch.distributed initialised, the world is this process.

    Returns:
        A `ScoredStep`, the same on every rank; None without scorers.

    Raises:
        ValueError: when `reward_weights` does not have one weight per column.
        RuntimeError: when a scorer's `features` left out a sample of a pending group.
    """
    if not scorers:
        return None
    names = [*step.reward_names, *(scorer.name for scorer in scorers)]
    weights = np.ones(len(names)) if reward_weights is None else np.asarray(reward_weights, dtype=np.float64)
    if weights.shape != (len(names),):
        raise ValueError(
            f"`reward_weights` has {weights.size} weights, but the step has {len(names)} reward columns {names} "
            "(the rollout's, then one per trainer scorer): pass one weight per column."
        )
    with torch.no_grad():
        local = {
            "samples": _local_samples(step.micro_batches, len(step.reward_names)),
            "features": _local_features(module, step, scorers),
        }
    gathered = _all_gather(local, group)
    table = _SampleTable.merge([g["samples"] for g in gathered])
    features = [_merge_features([g["features"][k] for g in gathered]) for k in range(len(scorers))]
    options = (aggregation, scale_rewards, advantage_estimator)
    scored = _score_groups(table, features, scorers, weights, options, names)
    scored.trained = _trains(table, scored, mask_truncated_completions, drop_no_signal_groups)
    _rewrite_micro_batches(step.micro_batches, table, scored)
    scored.excluded_group_ids = [
        g for g in scored.group_ids if not scored.trained[table.group_of(scored.uids) == g].any()
    ]
    _report(scored, table, progress, mask_truncated_completions)
    return scored


@dataclass(slots=True)
class _SampleTable:
    """Every rank's samples of the step, gathered: one entry per real sample (filler left out)."""

    uid: np.ndarray  # (U,) sorted
    group_id: np.ndarray
    truncated: np.ndarray
    terms: np.ndarray  # loss terms per sample
    rewards: np.ndarray  # (U, C)
    advantage: np.ndarray  # NaN: pending, or unknown (a sample without loss terms nor `sample_advantage`)

    @classmethod
    def merge(cls, parts: list[dict[str, np.ndarray]]) -> _SampleTable:
        merged = {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}
        keep = merged["uid"] >= 0
        order = np.argsort(merged["uid"][keep], kind="stable")
        return cls(**{key: value[keep][order] for key, value in merged.items()})

    def group_of(self, uids: np.ndarray) -> np.ndarray:
        return self.group_id[np.searchsorted(self.uid, uids)]

    def pending_groups(self) -> list[int]:
        """Groups with a NaN advantage on some sample and a number on none, in order of first uid."""
        pending = dict.fromkeys(self.group_id[np.isnan(self.advantage)].tolist())
        known = set(self.group_id[~np.isnan(self.advantage)].tolist())
        return [g for g in pending if g not in known]


def _local_samples(micro_batches: list[MicroBatch], num_columns: int) -> dict[str, np.ndarray]:
    """Per-sample data of this rank's rows, as numpy arrays to gather."""
    parts = defaultdict(list)
    for mb in micro_batches:
        num = mb["sample_uid"].numel()
        segment = mb["segment_id"].long().cpu()
        terms = torch.bincount(segment, minlength=num)
        if "sample_advantage" in mb:
            advantage = mb["sample_advantage"].float().cpu()
        else:  # every term of a sample carries its advantage
            advantage = torch.full((num,), math.nan).index_copy_(0, segment, mb["advantages"].float().cpu())
        parts["uid"].append(mb["sample_uid"].cpu().numpy())
        parts["group_id"].append(mb["sample_group_id"].cpu().numpy())
        parts["truncated"].append(mb["sample_truncated"].cpu().numpy().astype(bool))
        parts["terms"].append(terms.numpy())
        parts["rewards"].append(mb["rollout_rewards"].float().cpu().numpy().reshape(num, num_columns))
        parts["advantage"].append(advantage.numpy())
    return {key: np.concatenate(value) for key, value in parts.items()}


def _local_features(module: torch.nn.Module, step: StepBatch, scorers: Sequence[TrainerScorer]) -> list[dict]:
    """Each scorer's `(uids, features)` over this rank's chunks, as numpy."""
    out = []
    for index, scorer in enumerate(scorers):
        uids, feats = [], []
        for mb in step.micro_batches:
            for chunk in chunk_inputs(_scorer_inputs(mb, index)):
                chunk_uids, chunk_features = scorer.features(module, chunk)
                chunk_features = torch.as_tensor(chunk_features).detach().float().cpu()
                uids.append(torch.as_tensor(chunk_uids).long().cpu().numpy().reshape(-1))
                num = len(uids[-1])  # a chunk may report nothing (say, only fillers)
                feats.append(chunk_features.reshape(num, -1).numpy() if num else np.zeros((0, 1), np.float32))
        out.append({"uids": uids, "features": feats})
    return out


def _scorer_inputs(micro_batch: MicroBatch, index: int) -> dict[str, torch.Tensor]:
    prefix = re.compile(rf"s{index}_(.+)")
    return {m.group(1): value for key, value in micro_batch.items() if (m := prefix.fullmatch(key))}


@dataclass(slots=True)
class _Features:
    """One scorer's gathered features: per sample uid, and per group its extras by index."""

    samples: dict[int, np.ndarray]
    extras: dict[int, dict[int, np.ndarray]]


def _merge_features(parts: list[dict]) -> _Features:
    """Every rank's `(uids, features)` chunks of one scorer, by uid (fillers dropped)."""
    merged = _Features({}, defaultdict(dict))
    for part in parts:
        for uids, feats in zip(part["uids"], part["features"], strict=True):
            for uid, feat in zip(uids.tolist(), feats, strict=True):
                if uid > FILLER_UID:
                    merged.samples[uid] = feat
                elif uid < FILLER_UID:
                    group_id, index = decode_extra_uid(uid)
                    merged.extras[group_id][index] = feat
    return merged


def _all_gather(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _score_groups(
    table: _SampleTable,
    features: list[_Features],
    scorers: Sequence[TrainerScorer],
    weights: np.ndarray,
    options: tuple[Aggregation, ScaleRewards, AdvantageEstimator],
    names: list[str],
) -> ScoredStep:
    """Columns and advantages of the pending groups (the same on every rank: gathered inputs, fixed order)."""
    group_ids = table.pending_groups()
    columns, uids, metric_values = [], [], defaultdict(list)
    for group_id in group_ids:
        members = table.uid[table.group_id == group_id]
        rows = [table.rewards[np.searchsorted(table.uid, members)].T]
        for scorer, scorer_features in zip(scorers, features, strict=True):
            rewards, metrics = _scorer_column(scorer, scorer_features, members, group_id)
            rows.append(rewards[None])
            for key, value in metrics.items():
                metric_values[f"scoring/{scorer.name}/{key}"].append(float(value))
        columns.append(np.concatenate(rows).astype(np.float64))
        uids.append(members)
    advantages = _advantages(columns, weights, *options)
    empty = np.zeros(0)
    scored = ScoredStep(
        reward_names=names,
        uids=np.concatenate(uids) if uids else empty.astype(np.int64),
        rewards=np.concatenate(columns, axis=1).T if columns else np.zeros((0, len(names))),
        advantages=np.concatenate(advantages) if advantages else empty,
        trained=empty.astype(bool),
        group_ids=group_ids,
    )
    scored.metrics = {key: sum(values) / len(values) for key, values in metric_values.items()}
    return scored


def _scorer_column(
    scorer: TrainerScorer, features: _Features, members: np.ndarray, group_id: int
) -> tuple[np.ndarray, dict[str, float]]:
    missing = [uid for uid in members.tolist() if uid not in features.samples]
    if missing:
        raise RuntimeError(
            f"Trainer scorer {scorer.name!r} returned no features for samples {missing[:10]} of group {group_id}; "
            "its `collate` must give every sample of a row to `features`, which must report each one's uid."
        )
    sample_features = torch.from_numpy(np.stack([features.samples[uid] for uid in members.tolist()]))
    extras = features.extras.get(group_id, {})
    if extras:
        extra_features = torch.from_numpy(np.stack([extras[index] for index in sorted(extras)]))
    else:
        extra_features = sample_features.new_zeros((0, *sample_features.shape[1:]))
    rewards, metrics = scorer.group_rewards(sample_features, extra_features)
    rewards = np.asarray(torch.as_tensor(rewards, dtype=torch.float64).cpu(), dtype=np.float64).reshape(-1)
    if rewards.shape != members.shape:
        raise RuntimeError(
            f"Trainer scorer {scorer.name!r}.group_rewards returned {rewards.size} rewards for a group of "
            f"{members.size} samples; return one per sample (NaN = not scored)."
        )
    return rewards, metrics


def _advantages(
    columns: list[np.ndarray],
    weights: np.ndarray,
    aggregation: Aggregation,
    scale_rewards: ScaleRewards,
    estimator: AdvantageEstimator,
) -> list[np.ndarray]:
    """Each group's advantages; with `scale_rewards="batch"` the step's pending groups are the batch."""
    if scale_rewards != "batch":
        return [
            compute_group_advantages(c, weights, aggregation, scale_rewards, estimator=estimator)[1] for c in columns
        ]
    centred = [compute_group_advantages(c, weights, aggregation, "none", estimator=estimator)[1] for c in columns]
    signals = [learning_signal(c, weights, aggregation) for c in columns]
    return batch_advantages(signals, centred, estimator)


def _trains(
    table: _SampleTable, scored: ScoredStep, mask_truncated_completions: bool, drop_no_signal_groups: bool
) -> np.ndarray:
    index = np.searchsorted(table.uid, scored.uids)
    keep = table.terms[index] > 0
    if drop_no_signal_groups:
        keep &= scored.advantages != 0.0
    if mask_truncated_completions:
        keep &= ~table.truncated[index]
    return keep


def _rewrite_micro_batches(micro_batches: list[MicroBatch], table: _SampleTable, scored: ScoredStep) -> None:
    """Write the scored advantages per loss term, drop the masked samples' terms, and reset the normalizer."""
    advantage = dict(zip(scored.uids.tolist(), scored.advantages.tolist(), strict=True))
    trained = dict(zip(scored.uids.tolist(), scored.trained.tolist(), strict=True))
    masked = np.zeros(table.uid.shape, dtype=bool)
    masked[np.searchsorted(table.uid, scored.uids[~scored.trained])] = True
    tokens = float(table.terms[~masked].sum())
    sequences = float(((table.terms > 0) & ~masked).sum())
    for mb in micro_batches:
        uids = mb["sample_uid"].tolist()
        per_sample = torch.tensor([advantage.get(uid, math.nan) for uid in uids], dtype=torch.float32)
        scored_here = torch.tensor([uid in advantage for uid in uids], dtype=torch.bool)
        keep_sample = torch.tensor([trained.get(uid, True) for uid in uids], dtype=torch.bool)
        segment = mb["segment_id"].long().cpu()
        keep = keep_sample[segment]
        values = torch.where(scored_here[segment], per_sample[segment], mb["advantages"].float().cpu())
        device = mb["advantages"].device
        mb["advantages"] = values[keep].to(device=device, dtype=mb["advantages"].dtype)
        for key in ("token_index", "old_log_probs", "segment_id"):
            mb[key] = mb[key][keep.to(mb[key].device)]
        if "sample_advantage" in mb:
            mb["sample_advantage"] = torch.where(scored_here, per_sample, mb["sample_advantage"].float().cpu()).to(
                mb["sample_advantage"]
            )
        write_step_normalizers(mb, tokens=tokens, sequences=sequences)


def _report(
    scored: ScoredStep, table: _SampleTable, progress: RolloutProgress | None, mask_truncated_completions: bool
) -> None:
    """Count the step's scoring in `scored.metrics`; on rank 0 report the scored groups to `progress`."""
    excluded = set(scored.excluded_group_ids)
    index = np.searchsorted(table.uid, scored.uids)
    scored.metrics.update(
        {
            "scoring/groups_total": float(len(scored.group_ids)),
            "scoring/excluded_groups_total": float(len(excluded)),
            "scoring/masked_samples_total": float((~scored.trained).sum()),
            "scoring/masked_tokens_total": float(table.terms[index][~scored.trained].sum()),
        }
    )
    for k, name in enumerate(scored.reward_names[table.rewards.shape[1] :], start=table.rewards.shape[1]):
        values = scored.rewards[:, k]
        values = values[~np.isnan(values)]
        scored.metrics[f"rewards/{name}"] = float(values.mean()) if values.size else math.nan
    if progress is None or (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0):
        return
    trained_groups = [g for g in scored.group_ids if g not in excluded]
    if trained_groups:
        progress.train(trained_groups)
    group_of = table.group_of(scored.uids)
    for group_id in scored.excluded_group_ids:
        members = group_of == group_id
        signal = scored.advantages[members] != 0.0
        truncated = table.truncated[index][members]
        reason = "truncated" if mask_truncated_completions and (signal & truncated).any() else "no_signal"
        progress.exclude(group_id, reason)


def score_module_step(
    module: torch.nn.Module,
    step: StepBatch,
    contract: RolloutContract,
    scorers: Sequence[TrainerScorer],
    scorer_weights: Sequence[float] | None,
    progress: RolloutProgress | None,
    group: dist.ProcessGroup | None,
) -> ScoredStep | None:
    """`score_step` with `GRPOModule`'s `scorers` (`module` is what their `features` get), their `scorer_weights`
    (None: 1 each) after the rollout columns' `contract.reward_weights`, and the contract's advantage options; every
    rank calls it. `progress` is rank 0's ledger, `group` the data module's process group."""
    weights = list(scorer_weights) if scorer_weights else [1.0] * len(scorers)
    return score_step(
        module,
        step,
        scorers=scorers,
        reward_weights=[*contract.reward_weights, *weights],
        aggregation=contract.multi_objective_aggregation,
        scale_rewards=contract.scale_rewards,
        mask_truncated_completions=contract.mask_truncated_completions,
        progress=progress,
        group=group,
        advantage_estimator=contract.advantage_estimator,
        drop_no_signal_groups=contract.drop_no_signal_groups,
    )
