"""Advantages against TRL 1.16's own advantage block (`GRPOTrainer._generate_and_score_completions`, and
`RLOOTrainer`'s for the leave-one-out baseline), on the same reward columns: trainer-scored steps (`score_step`),
rollout-scored steps (the rollout loop's group form, then the collator's batch form), and each estimator."""

from __future__ import annotations

import numpy as np
import pytest
from packed_rows import collate_step, plan_step, rollout_group, tiny_reward_model
from trl_grpo import generate_and_score, grpo_trainer

from lightning_grpo.scoring.scorers import RewardModelScorer
from lightning_grpo.scoring.step import score_step

NAN = float("nan")
MODULE = __import__("torch").nn.Linear(1, 1)  # score_step only reads the module's device


def trl_advantages(rewards_per_func: np.ndarray, *, trainer_cls=None, **config) -> np.ndarray:
    """TRL's advantages of `(B, num_funcs)` rewards in groups of `num_generations` (one batch)."""
    weights = config.pop("reward_weights", None)
    extra = {"trainer_cls": trainer_cls, "beta": 0.0} if trainer_cls is not None else {}
    trainer = grpo_trainer(
        per_device_train_batch_size=rewards_per_func.shape[0],
        vllm_importance_sampling_correction=False,
        **extra,
        **config,
    )
    return generate_and_score(trainer, rewards_per_func, reward_weights=weights)["advantages"].numpy()


def scored_pending_step(groups, aggregation: str, scale_rewards: str, weights=(1.0, 2.0)):
    scorers = [RewardModelScorer(tiny_reward_model(0), name="rm")]
    plan = plan_step(groups, num_processes=1, steps=2, samples_per_row=4, scorers=scorers)
    step = collate_step(plan, scorers, num_processes=1, reward_names=["accuracy"])[0]
    return score_step(
        MODULE,
        step,
        scorers=scorers,
        reward_weights=list(weights),
        aggregation=aggregation,
        scale_rewards=scale_rewards,
    )


def test_normalize_then_sum_with_batch_scaling_is_trls_whole_batch_form_also_with_unscored_completions():
    """GDPO under `scale_rewards="batch"`: per-group z-scores of each column, their weighted sum, then that sum
    centred and scaled over the whole batch, as GRPOTrainer does. A column that left some completions unscored makes
    the summed z-scores of a group not centred, which is where a per-group form would differ."""
    groups = [
        rollout_group(0, 5, [3, 4, 2, 5], seed=0, rewards=[1, NAN, 0, 1]),
        rollout_group(1, 4, [2, 3, 4, 2], seed=1, rewards=[0, 1, 1, NAN]),
        rollout_group(2, 6, [4, 2, 3, 3], seed=2, rewards=[1, 0, 0, 0]),
    ]
    scored = scored_pending_step(groups, "normalize_then_sum", "batch")
    expected = trl_advantages(
        scored.rewards,
        num_generations=4,
        multi_objective_aggregation="normalize_then_sum",
        scale_rewards="batch",
        reward_weights=[1.0, 2.0],
    )
    np.testing.assert_allclose(scored.advantages, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_trainer_scored_sum_then_normalize_is_trls_for_every_scaling(scale_rewards):
    groups = [
        rollout_group(0, 5, [3, 4, 2, 5], seed=0, rewards=[1, NAN, 0, 1]),
        rollout_group(1, 4, [2, 3, 4, 2], seed=1, rewards=[0, 1, 1, 0]),
    ]
    scored = scored_pending_step(groups, "sum_then_normalize", scale_rewards)
    expected = trl_advantages(scored.rewards, num_generations=4, scale_rewards=scale_rewards, reward_weights=[1.0, 2.0])
    np.testing.assert_allclose(scored.advantages, expected, rtol=1e-5, atol=1e-6)
