"""Advantages against TRL 1.16's own advantage block (`GRPOTrainer._generate_and_score_completions`, and
`RLOOTrainer`'s for the leave-one-out baseline), on the same reward columns: trainer-scored steps (`score_step`),
rollout-scored steps (the rollout loop's group form, then the collator's batch form), and each estimator."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.tiny import collate_step, plan_step, rollout_group, tiny_reward_model
from helpers.trl_grpo import RLOOTrainer, generate_and_score, grpo_trainer

from lightning_grpo.scoring.builtin_scorers import RewardModelScorer
from lightning_grpo.scoring.step import score_step

NAN = float("nan")
MODULE = __import__("torch").nn.Linear(1, 1)  # score_step only reads the module's device


def trl_advantages(rewards_per_func: np.ndarray, *, trainer_cls=None, **config) -> np.ndarray:
    """TRL's advantages of `(B, num_funcs)` rewards in groups of `num_generations` (one batch)."""
    weights = config.pop("reward_weights", None)
    if trainer_cls is None:
        extra = {"vllm_importance_sampling_correction": False}
    else:
        extra = {"trainer_cls": trainer_cls, "beta": 0.0}
    trainer = grpo_trainer(per_device_train_batch_size=rewards_per_func.shape[0], **extra, **config)
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


def test_rloo_is_trls_leave_one_out_baseline_with_unscored_completions():
    """`advantage_estimator="rloo"` with `scale_rewards="none"` is TRL's RLOOTrainer (`normalize_advantages=False`):
    each completion against the mean of its group's other scored completions; an unscored one gets 0, and so does a
    group with a single scored completion."""
    from lightning_grpo.rollout.advantages import compute_group_advantages

    rewards = np.array([[1.0, 0.0, 0.5, 1.0], [0.2, NAN, 0.9, 0.4], [NAN, NAN, 1.0, NAN]])
    ours = np.concatenate(
        [compute_group_advantages(row[None], np.ones(1), scale_rewards="none", estimator="rloo")[1] for row in rewards]
    )
    expected = trl_advantages(rewards.reshape(-1, 1), trainer_cls=RLOOTrainer, num_generations=4)
    np.testing.assert_allclose(ours, expected, rtol=1e-6, atol=1e-7)


def test_reinforce_plus_plus_normalises_group_centred_advantages_over_the_batch():
    """REINFORCE++-baseline: the group mean as baseline, then one standard deviation of those centred advantages
    over the whole batch (which have a zero batch mean); a constant group stays exactly 0."""
    from lightning_grpo.rollout.advantages import batch_advantages, compute_group_advantages, learning_signal

    columns = [np.array([[1.0, 0.0, 0.0, 1.0]]), np.array([[0.3, 0.9, NAN, 0.6]]), np.full((1, 4), 0.5)]
    centred = [compute_group_advantages(c, np.ones(1), scale_rewards="none")[1] for c in columns]
    signals = [learning_signal(c, np.ones(1)) for c in columns]
    scaled = batch_advantages(signals, centred, "reinforce_plus_plus")
    scored = np.concatenate([a[~np.isnan(s)] for a, s in zip(scaled, signals, strict=True)])
    assert abs(scored.mean()) < 1e-12
    raw = np.concatenate([c[~np.isnan(s)] for c, s in zip(centred, signals, strict=True)])
    assert scored.std(ddof=1) == pytest.approx(raw.std(ddof=1) / (raw.std(ddof=1) + 1e-4))
    assert np.all(scaled[2] == 0.0) and scaled[1][2] == 0.0
    # grpo's batch form divides by the rewards' std instead (GRPOTrainer's): a different scale on the same step
    grpo = batch_advantages(signals, centred, "grpo")
    assert not np.allclose(np.concatenate(grpo), np.concatenate(scaled))


def test_rollout_scored_batch_scaling_in_the_collator_is_trls_over_the_step():
    """Without trainer scorers the rollout loop sends each sample's group-centred advantage and its learning signal;
    the collator scales them over the step, in the packed terms and the step's samples."""
    from lightning_grpo.pipeline.collating import ProgressCollator
    from lightning_grpo.rollout.advantages import compute_group_advantages, learning_signal
    from lightning_grpo.rollout.records import LEARNING_SIGNAL

    rewards = [[1, 0, 0, 1], [0.2, NAN, 0.9, 0.4], [0.1, 0.3, 0.2, 0.8]]
    groups = []
    for g, group_rewards in enumerate(rewards):
        group = rollout_group(g, 4, [3, 2, 4, 3], seed=g, rewards=group_rewards)
        column = np.array([group_rewards], dtype=float)
        centred = compute_group_advantages(column, np.ones(1), scale_rewards="none")[1]
        for sample, advantage, signal in zip(group, centred, learning_signal(column, np.ones(1)), strict=True):
            sample.advantage = float(advantage)
            sample.extras[LEARNING_SIGNAL] = float(signal)
        groups.append(group)
    plan = plan_step(groups, num_processes=2, steps=1, samples_per_row=6)
    batches = ProgressCollator(num_processes=2, reward_names=["accuracy"], scale_rewards="batch")(plan)
    expected = trl_advantages(np.array(rewards, dtype=float).reshape(-1, 1), num_generations=4, scale_rewards="batch")
    got = {}
    for batch in batches:
        for mb in batch.micro_batches:
            got.update(zip(mb["sample_uid"].tolist(), mb["sample_advantage"].tolist(), strict=True))
            terms = mb["advantages"].tolist()
            assert terms == [mb["sample_advantage"][s].item() for s in mb["segment_id"].tolist()]
    order = [s.group_id * 4 + next(k for k, x in enumerate(groups[s.group_id]) if x is s) for s in batches[0].samples]
    np.testing.assert_allclose([got[uid] for uid in range(12)], expected[order], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose([s.advantage for s in batches[0].samples], expected[order], rtol=1e-5, atol=1e-6)


def test_reinforce_plus_plus_needs_batch_scaling():
    from lightning_grpo import GRPODataModule

    with pytest.raises(ValueError, match=r"advantage_estimator='reinforce_plus_plus' with scale_rewards='group'"):
        GRPODataModule(model="tiny-random", advantage_estimator="reinforce_plus_plus")
    GRPODataModule(model="tiny-random", advantage_estimator="reinforce_plus_plus", scale_rewards="batch")
