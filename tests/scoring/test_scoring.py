"""score_step: the same advantages on one and on two (gloo) processes, masking of samples that carry no gradient,
exclusion of groups a scorer gives no signal, known groups untouched, and the advantage options.

Steps are planned by the real `StepPlanner` and packed by the real `ProgressCollator`, with each scorer's `collate`
output added under `s{index}_` keys (what `ScoringCollator` adds); scorers are tiny random reward models.
"""

from __future__ import annotations

import math
import pickle
from collections import defaultdict

import numpy as np
import pytest
import torch
from helpers.processes import run_ranks
from helpers.tiny import (
    collate_step,
    one_process_plan,
    plan_step,
    rollout_group,
    tiny_reward_model,
)

from lightning_grpo.pipeline.ledger import RolloutProgress
from lightning_grpo.rollout.advantages import compute_group_advantages
from lightning_grpo.scoring.builtin_scorers import RewardModelScorer
from lightning_grpo.scoring.step import ScoredStep, score_step
from lightning_grpo.scoring.trainer_scorer import TrainerScorer, decode_extra_uid, extra_uid

MODULE = torch.nn.Linear(1, 1)  # score_step only reads the module's device


def rm(constant: bool = False, **kwargs) -> RewardModelScorer:
    return RewardModelScorer(tiny_reward_model(0, constant=constant), name="const" if constant else "rm", **kwargs)


def one_rank_step(groups, scorers, *, progress=None, reward_names=("accuracy",)):
    plan = plan_step(groups, num_processes=1, steps=4, samples_per_row=3, scorers=scorers)
    return collate_step(plan, scorers, num_processes=1, reward_names=list(reward_names), progress=progress)[0]


def terms_by_uid(micro_batches) -> dict[int, tuple[list[float], int]]:
    """uid -> (distinct advantages on its loss terms, number of terms), over micro-batches."""
    found: dict[int, list[float]] = defaultdict(list)
    for mb in micro_batches:
        uids = mb["sample_uid"][mb["segment_id"]].tolist()
        for uid, adv in zip(uids, mb["advantages"].tolist(), strict=True):
            found[uid].append(adv)
    return {uid: (sorted(set(advs)), len(advs)) for uid, advs in found.items()}


def mixed_groups() -> list:
    """Three pending groups (one with a truncated sample, one without rollout rewards) and a known group."""
    return [
        rollout_group(0, 6, [3, 5, 4, 6], seed=0, rewards=[1, 0, 1, 0], truncated=[False, True, False, False]),
        rollout_group(1, 4, [2, 7, 5, 3], seed=1),
        rollout_group(2, 8, [4, 4, 6, 2], seed=2, rewards=[0, 0, 1, 1]),
        rollout_group(3, 5, [5, 3], seed=3, rewards=[1, 0], advantage=0.5),
    ]


@pytest.mark.timeout(180)
def test_score_step_gives_the_same_advantages_on_one_and_two_processes(tmp_path, no_leaked_processes):
    kwargs = {"reward_weights": [1.0, 2.0], "mask_truncated_completions": True}
    scorers = [rm()]
    plan = plan_step(mixed_groups(), num_processes=2, steps=2, samples_per_row=4, scorers=scorers)
    two_ranks = collate_step(plan, scorers, num_processes=2, reward_names=["accuracy"])
    one_rank = collate_step(one_process_plan(plan), scorers, num_processes=1, reward_names=["accuracy"])[0]
    expected = score_step(MODULE, one_rank, scorers=scorers, **kwargs)

    (tmp_path / "batches.pkl").write_bytes(pickle.dumps((two_ranks, kwargs)))
    run_ranks(2, tmp_path, timeout=150)
    ranks = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(2)]

    for rank in ranks:
        got: ScoredStep = rank["result"]
        assert got.uids.tolist() == expected.uids.tolist()
        np.testing.assert_allclose(got.advantages, expected.advantages, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got.rewards, expected.rewards, rtol=1e-5, atol=1e-6)
        assert got.trained.tolist() == expected.trained.tolist()
    two_rank_terms = {}
    for rank in ranks:
        two_rank_terms.update(terms_by_uid(rank["micro_batches"]))
        assert all(
            mb["step_trained_tokens"].item() == one_rank.micro_batches[0]["step_trained_tokens"].item()
            for mb in rank["micro_batches"]
        )
    one_rank_terms = terms_by_uid(one_rank.micro_batches)
    assert two_rank_terms.keys() == one_rank_terms.keys()
    for uid, (advs, count) in one_rank_terms.items():
        assert two_rank_terms[uid][1] == count
        np.testing.assert_allclose(two_rank_terms[uid][0], advs, rtol=1e-5)
    # the truncated sample of group 0 (uid 1) left the loss, the known group 3 kept its advantage
    assert 1 not in one_rank_terms and expected.trained.tolist().count(False) == 1
    assert {one_rank_terms[uid][0][0] for uid in (12, 13)} == {0.5}


def test_constant_reward_scorer_excludes_its_groups_instead_of_training_them():
    groups = [rollout_group(g, 5, [3, 4, 2], seed=g) for g in range(3)]  # no rollout rewards: NaN
    progress = RolloutProgress(total_groups=10, stall_groups=10)
    scorers = [rm(constant=True)]
    step = one_rank_step(groups, scorers, progress=progress)
    scored = score_step(MODULE, step, scorers=scorers, progress=progress)
    assert scored.excluded_group_ids == [0, 1, 2] and not scored.trained.any()
    assert progress.excluded["no_signal"] == 3 and progress.consumed == {0, 1, 2}
    progress.commit([0, 1, 2])  # nothing is left held: every scored group was reported
    for mb in step.micro_batches:
        assert mb["token_index"].numel() == mb["advantages"].numel() == mb["segment_id"].numel() == 0
        assert mb["step_trained_tokens"].item() == 0.0
    assert scored.metrics["scoring/excluded_groups_total"] == 3.0


def test_zero_advantage_sample_leaves_the_loss_and_the_normalizer():
    groups = [rollout_group(0, 5, [3, 4, 6], seed=0, rewards=[2.0, 1.0, 0.0])]  # the middle one is the mean
    progress = RolloutProgress(total_groups=4, stall_groups=4)
    scorers = [rm()]
    step = one_rank_step(groups, scorers, progress=progress)
    scored = score_step(MODULE, step, scorers=scorers, reward_weights=[1.0, 0.0], progress=progress)
    assert scored.advantages[1] == 0.0 and scored.trained.tolist() == [True, False, True]
    terms = terms_by_uid(step.micro_batches)
    assert 1 not in terms and terms[0][1] == 3 and terms[2][1] == 6
    assert step.micro_batches[0]["step_trained_tokens"].item() == 9.0
    assert progress.consumed == {0} and not progress.excluded


def test_without_dropping_zero_advantage_samples_train_and_count_in_the_normalizer():
    """`drop_no_signal_groups=False` (GRPOTrainer's behaviour): the mean sample and a constant scorer's groups keep
    their terms, with advantage 0, and count in the step's normaliser; every group is reported as trained."""
    groups = [rollout_group(0, 5, [3, 4, 6], seed=0, rewards=[2.0, 1.0, 0.0])]
    progress = RolloutProgress(total_groups=4, stall_groups=4)
    scorers = [rm()]
    step = one_rank_step(groups, scorers, progress=progress)
    scored = score_step(
        MODULE, step, scorers=scorers, reward_weights=[1.0, 0.0], progress=progress, drop_no_signal_groups=False
    )
    assert scored.advantages[1] == 0.0 and scored.trained.all()
    terms = terms_by_uid(step.micro_batches)
    assert terms[1] == ([0.0], 4) and step.micro_batches[0]["step_trained_tokens"].item() == 13.0
    assert progress.consumed == {0} and not progress.excluded

    constant = [rm(constant=True)]
    groups = [rollout_group(g, 5, [3, 4, 2], seed=g) for g in range(1, 3)]
    step = one_rank_step(groups, constant, progress=progress)
    scored = score_step(MODULE, step, scorers=constant, progress=progress, drop_no_signal_groups=False)
    assert scored.excluded_group_ids == [] and scored.trained.all() and not (scored.advantages != 0).any()
    assert step.micro_batches[0]["step_trained_tokens"].item() == 18.0
    assert progress.consumed == {0, 1, 2} and not progress.excluded


def test_known_groups_pass_through_untouched():
    groups = [rollout_group(0, 4, [3, 3], seed=0, rewards=[1, 0], advantage=0.7), rollout_group(1, 4, [2, 5], seed=1)]
    scorers = [rm()]
    step = one_rank_step(groups, scorers)
    before = [{k: v.clone() for k, v in mb.items()} for mb in step.micro_batches]
    scored = score_step(MODULE, step, scorers=scorers)
    assert scored.group_ids == [1]
    for old, new in zip(before, step.micro_batches, strict=True):
        known = old["sample_group_id"][old["segment_id"]] == 0
        assert torch.equal(new["token_index"], old["token_index"])  # nothing was masked
        assert torch.equal(new["advantages"][known], old["advantages"][known])
        assert not new["advantages"][~known].isnan().any()  # the pending group got its advantages
    terms = terms_by_uid(step.micro_batches)
    assert terms[0] == ([pytest.approx(0.7)], 3) and terms[1] == ([pytest.approx(0.7)], 3)


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_advantages_follow_compute_group_advantages(aggregation, scale_rewards):
    groups = [rollout_group(g, 5, [3, 4, 2, 5], seed=g, rewards=[1, 0, g % 2, 0]) for g in range(3)]
    scorers = [rm()]
    step = one_rank_step(groups, scorers)
    weights = [1.0, 3.0]
    scored = score_step(
        MODULE, step, scorers=scorers, reward_weights=weights, aggregation=aggregation, scale_rewards=scale_rewards
    )
    columns = [scored.rewards[4 * g : 4 * g + 4].T for g in range(3)]
    batch_std = None
    if scale_rewards == "batch":
        if aggregation == "sum_then_normalize":
            signal = np.concatenate([np.nansum(np.array(weights)[:, None] * c, axis=0) for c in columns])
        else:
            signal = np.concatenate([compute_group_advantages(c, weights, aggregation, "none")[1] for c in columns])
        batch_std = signal.std(ddof=1)
    expected = np.concatenate(
        [compute_group_advantages(c, weights, aggregation, scale_rewards, batch_std=batch_std)[1] for c in columns]
    )
    np.testing.assert_allclose(scored.advantages, expected, rtol=1e-6)
    assert np.isfinite(scored.rewards[:, 1]).all()  # the reward model scored every sample
    assert scored.metrics["rewards/rm"] == pytest.approx(scored.rewards[:, 1].mean())


def test_truncation_that_masks_every_sample_with_signal_excludes_the_group_as_truncated():
    groups = [rollout_group(0, 4, [3, 3, 3], seed=0, rewards=[1, 0, 1], truncated=[True, True, True])]
    progress = RolloutProgress(total_groups=2, stall_groups=2)
    scorers = [rm()]
    step = one_rank_step(groups, scorers, progress=progress)
    scored = score_step(
        MODULE, step, scorers=scorers, reward_weights=[1.0, 0.0], mask_truncated_completions=True, progress=progress
    )
    assert scored.excluded_group_ids == [0] and progress.excluded["truncated"] == 1
    assert step.micro_batches[0]["step_trained_tokens"].item() == 0.0


def test_chunked_scorer_inputs_give_the_same_rewards():
    groups = [rollout_group(g, 6, [5, 7, 3], seed=g, rewards=[1, 0, 0]) for g in range(2)]
    whole, chunked = [rm()], [rm(token_budget=12)]
    step_whole, step_chunked = one_rank_step(groups, whole), one_rank_step(groups, chunked)
    assert any(key.startswith("s0_c1_") for key in step_chunked.micro_batches[0])
    a = score_step(MODULE, step_whole, scorers=whole)
    b = score_step(MODULE, step_chunked, scorers=chunked)
    np.testing.assert_allclose(a.rewards, b.rewards, rtol=1e-5, atol=1e-6)


class _ForgetfulScorer(TrainerScorer):
    """Leaves sample uid 1 out of its features: a broken `features`."""

    name = "forgetful"

    def __init__(self) -> None:
        self.inner = rm()

    def collate(self, rows, index):
        return self.inner.collate(rows, index)

    def features(self, module, inputs):
        uids, feats = self.inner.features(module, inputs)
        return uids[uids != 1], feats[uids != 1]

    def group_rewards(self, sample_features, extra_features):
        return sample_features[:, 0], {}


def test_scorer_that_loses_a_sample_raises_naming_it():
    scorers = [_ForgetfulScorer()]
    step = one_rank_step([rollout_group(0, 4, [2, 3], seed=0)], scorers)
    with pytest.raises(RuntimeError, match="'forgetful' returned no features for samples \\[1\\] of group 0"):
        score_step(MODULE, step, scorers=scorers)


def test_reward_weights_must_cover_rollout_and_scorer_columns():
    scorers = [rm()]
    step = one_rank_step([rollout_group(0, 4, [2, 3], seed=0)], scorers)
    with pytest.raises(ValueError, match=r"2 reward columns \['accuracy', 'rm'\]"):
        score_step(MODULE, step, scorers=scorers, reward_weights=[1.0])


def test_without_scorers_nothing_changes():
    step = one_rank_step([rollout_group(0, 4, [2, 3], seed=0)], [])
    before = step.micro_batches[0]["advantages"].clone()
    assert score_step(MODULE, step, scorers=[]) is None
    assert torch.allclose(step.micro_batches[0]["advantages"], before, equal_nan=True)


def test_extra_uids_round_trip_and_never_collide_with_samples_or_filler():
    for group_id, index in [(0, 0), (0, 1), (7, 0), (123456, 65535)]:
        uid = extra_uid(group_id, index)
        assert uid < -1 and decode_extra_uid(uid) == (group_id, index)
    with pytest.raises(ValueError, match="index=65536"):
        extra_uid(0, 65536)
    assert not math.isnan(extra_uid(1, 0))
