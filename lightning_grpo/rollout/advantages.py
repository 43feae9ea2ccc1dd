"""GRPO group advantages from a group's reward columns, and their batch form (`scale_rewards="batch"`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import get_args

import numpy as np

from ..options import AdvantageEstimator, ScaleRewards
from ..options import MultiObjectiveAggregation as Aggregation

#: Added to a standard deviation before dividing by it, as TRL's GRPOTrainer does.
STD_EPSILON = 1e-4


def compute_group_advantages(
    rewards_per_func: np.ndarray,
    reward_weights: np.ndarray,
    aggregation: Aggregation = "sum_then_normalize",
    scale_rewards: ScaleRewards = "group",
    *,
    batch_std: float | None = None,
    estimator: AdvantageEstimator = "grpo",
) -> tuple[np.ndarray, np.ndarray]:
    """Return the weighted rewards and the advantages of one prompt group.

    Conventions (those of TRL's synchronous `GRPOTrainer`, whose reward options these are): standard deviations are
    Bessel-corrected (ddof=1) over the completions that were scored, and `STD_EPSILON` (1e-4) is added before
    dividing. TRL's async trainer uses the population std and 1e-8 instead, which blows a group whose rewards differ
    by rounding noise up to advantages of ±1.

    Args:
        rewards_per_func: `(num_funcs, group_size)` rewards, NaN where a function did not score a completion.
        reward_weights: `(num_funcs,)` weight of each reward function.
        aggregation: `"sum_then_normalize"` normalizes the weighted NaN-sum within the group. `"normalize_then_sum"`
            (GDPO, arXiv 2601.05242) z-scores each function within the group over the completions it scored (a
            function constant over the group contributes 0), takes the weighted NaN-sum, then normalizes that.
        scale_rewards: `"group"` divides the centred signal by the group's std, `"none"` only centres, `"batch"`
            divides by `batch_std`, which the caller computes over a whole batch of groups.
        batch_std: the batch's std of the learning signal; required with `scale_rewards="batch"`, else ignored.
            `batch_advantages` computes the batch form from each group's centred signal (`scale_rewards="none"`).
        estimator: the baseline subtracted from the learning signal: `"grpo"` (and `"reinforce_plus_plus"`, whose
            batch normalisation `batch_advantages` applies) the group's mean; `"rloo"` the mean of the group's other
            scored completions (TRL's `RLOOTrainer`), `n / (n - 1)` times the centred signal of `n` scored ones.

    Returns:
        `(rewards, advantages)`, each `(group_size,)`. `rewards` is the weighted NaN-sum, for logging. A completion
        no function scored keeps a NaN reward and a 0.0 advantage. A group whose learning signal is constant over its
        scored completions (including a group with one scored completion) gets advantages of exactly 0.0, so it can
        be told apart from a group that merely has small ones.

    Raises:
        ValueError: on a shape that is not `(num_funcs, group_size)`, a weights length that does not match, an
            unknown `aggregation`, `scale_rewards` or `estimator`, or `scale_rewards="batch"` without a valid
            `batch_std`.

    Example::

        import numpy as np

        from lightning_grpo import compute_group_advantages

        # one reward function and a group of 4 completions; the last one was not scored (NaN)
        rewards_per_func = np.array([[1.0, 0.0, 1.0, np.nan]])
        rewards, advantages = compute_group_advantages(rewards_per_func, np.array([1.0]))
        assert advantages[3] == 0.0 and advantages[0] > 0 > advantages[1]
    """
    if estimator not in get_args(AdvantageEstimator):
        raise ValueError(f"`estimator={estimator!r}` is not one of {list(get_args(AdvantageEstimator))}.")
    rewards_per_func, weights = _validated(rewards_per_func, reward_weights, aggregation, scale_rewards, batch_std)
    scored = ~np.all(np.isnan(rewards_per_func), axis=0)
    rewards = _weighted_nansum(rewards_per_func, weights, scored)
    signal = _signal(rewards_per_func, weights, aggregation, scored, rewards)
    advantages = np.zeros_like(rewards)
    values = signal[scored]
    if values.size == 0 or np.all(values == values[0]):
        return rewards, advantages
    baseline = (values.sum() - values) / (values.size - 1) if estimator == "rloo" else values.mean()
    centred = values - baseline
    if scale_rewards == "group":
        centred = centred / (values.std(ddof=1) + STD_EPSILON)
    elif scale_rewards == "batch" and batch_std is not None:  # `_validated` refused "batch" without one
        centred = centred / (batch_std + STD_EPSILON)
    advantages[scored] = centred
    return rewards, advantages


def learning_signal(
    rewards_per_func: np.ndarray, reward_weights: np.ndarray, aggregation: Aggregation = "sum_then_normalize"
) -> np.ndarray:
    """`(group_size,)` what `compute_group_advantages` centres and scales: the weighted NaN-sum of the rewards, or
    (`normalize_then_sum`) of each function's z-scores within the group; NaN where no function scored."""
    rewards_per_func, weights = _validated(rewards_per_func, reward_weights, aggregation, "none", None)
    scored = ~np.all(np.isnan(rewards_per_func), axis=0)
    return _signal(rewards_per_func, weights, aggregation, scored, _weighted_nansum(rewards_per_func, weights, scored))


def batch_advantages(
    signals: Sequence[np.ndarray], centred: Sequence[np.ndarray], estimator: AdvantageEstimator = "grpo"
) -> list[np.ndarray]:
    """The advantages of a batch of groups under `scale_rewards="batch"`: each group's centred signal divided by one
    standard deviation over the whole batch (Bessel-corrected, over the scored completions, plus `STD_EPSILON`).

    That deviation is the learning signal's (`learning_signal`), as GRPOTrainer's `scale_rewards="batch"` takes it:
    of the weighted rewards, or for `normalize_then_sum` of the summed z-scores, whose batch mean GRPOTrainer
    subtracts and which is exactly the group mean here (each function's z-scores sum to 0 over the completions it
    scored, so their weighted sum does too). With `estimator="reinforce_plus_plus"` it is the deviation of the
    group-centred advantages themselves, REINFORCE++-baseline's global normalisation (Hu et al. 2025). Zeros stay
    exactly zero: a completion no function scored, and a group with a constant signal.

    Args:
        signals: per group, `(group_size,)` its `learning_signal` (NaN = not scored).
        centred: per group, `(group_size,)` its advantages with `scale_rewards="none"` (the same estimator).
        estimator: see `compute_group_advantages`.

    Returns:
        Per group, `(group_size,)` its advantages.
    """
    if estimator not in get_args(AdvantageEstimator):
        raise ValueError(f"`estimator={estimator!r}` is not one of {list(get_args(AdvantageEstimator))}.")
    spread = centred if estimator == "reinforce_plus_plus" else signals
    scored = [
        np.asarray(values, dtype=np.float64)[~np.isnan(np.asarray(signal, dtype=np.float64))]
        for values, signal in zip(spread, signals, strict=True)
    ]
    values = np.concatenate(scored) if scored else np.zeros(0)
    std = float(values.std(ddof=1)) if values.size > 1 else 0.0
    return [np.asarray(group, dtype=np.float64) / (std + STD_EPSILON) for group in centred]


def _signal(
    rewards_per_func: np.ndarray, weights: np.ndarray, aggregation: str, scored: np.ndarray, rewards: np.ndarray
) -> np.ndarray:
    if aggregation == "normalize_then_sum":
        return _weighted_nansum(np.stack([_zscore(row) for row in rewards_per_func]), weights, scored)
    return rewards


def _weighted_nansum(columns: np.ndarray, weights: np.ndarray, scored: np.ndarray) -> np.ndarray:
    total = np.nansum(weights[:, None] * columns, axis=0)
    total[~scored] = np.nan
    return total


def _zscore(row: np.ndarray) -> np.ndarray:
    """One function's rewards z-scored over the completions it scored; exactly 0 where they are all equal."""
    out = np.full_like(row, np.nan)
    present = ~np.isnan(row)
    values = row[present]
    if values.size == 0:
        return out
    if np.all(values == values[0]):
        out[present] = 0.0
        return out
    out[present] = (values - values.mean()) / (values.std(ddof=1) + STD_EPSILON)
    return out


def _validated(
    rewards_per_func: np.ndarray,
    reward_weights: np.ndarray,
    aggregation: str,
    scale_rewards: str,
    batch_std: float | None,
) -> tuple[np.ndarray, np.ndarray]:
    if aggregation not in get_args(Aggregation):
        raise ValueError(f"`aggregation={aggregation!r}` is not one of {list(get_args(Aggregation))}.")
    if scale_rewards not in get_args(ScaleRewards):
        raise ValueError(f"`scale_rewards={scale_rewards!r}` is not one of {list(get_args(ScaleRewards))}.")
    rewards = np.asarray(rewards_per_func, dtype=np.float64)
    if rewards.ndim != 2 or rewards.shape[0] == 0 or rewards.shape[1] == 0:
        raise ValueError(
            f"`rewards_per_func` must have shape (num_funcs, group_size) with both at least 1, got shape "
            f"{rewards.shape}. Stack one row of rewards per reward function."
        )
    weights = np.asarray(reward_weights, dtype=np.float64)
    if weights.shape != (rewards.shape[0],):
        raise ValueError(
            f"`reward_weights` has shape {weights.shape}, but there are {rewards.shape[0]} reward columns: pass one "
            "weight per reward function (and per environment or rollout reward column)."
        )
    if not np.all(np.isfinite(weights)):
        raise ValueError(f"`reward_weights={weights.tolist()}` must be finite numbers.")
    if np.any(np.isinf(rewards)):
        raise ValueError("`rewards_per_func` holds an infinite reward; return None (NaN) for 'not scored' instead.")
    if scale_rewards == "batch" and (batch_std is None or not np.isfinite(batch_std) or batch_std < 0):
        raise ValueError(
            f"`scale_rewards='batch'` needs the batch's standard deviation as `batch_std`, got {batch_std!r}."
        )
    return rewards, weights
