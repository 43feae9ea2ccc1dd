"""Exact normalisation over ranks and micro-batches, for every loss type: one optimizer step on 1 rank with 1
micro-batch gives the same loss and gradients as the same step on 2 gloo ranks with 2 micro-batches each (real
processes, DDP's gradient averaging). Steps are planned and packed by the real `StepPlanner` and `ProgressCollator`,
whose `step_trained_tokens` and `step_sequences` carry the normalisers."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from helpers.loss_ranks import step_gradient
from helpers.processes import run_ranks
from helpers.tiny import collate_step, plan_step, rollout_group

from lightning_grpo.training.loss_options import LossOptions

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]


def groups() -> list:
    """Three groups of four with uneven completions; each sample its own advantage."""
    made = [
        rollout_group(0, 6, [3, 7, 2, 5], seed=0),
        rollout_group(1, 4, [6, 2, 4, 8], seed=1),
        rollout_group(2, 5, [4, 4, 1, 6], seed=2),
    ]
    rng = np.random.default_rng(0)
    for group in made:
        for sample in group:
            sample.advantage = float(rng.normal())
    return made


def steps(num_processes: int, micro_batches: int) -> list[list[dict]]:
    """Per rank, its micro-batches of the one step the real planner and collator make of `groups()`."""
    plan = plan_step(groups(), num_processes=num_processes, steps=micro_batches, samples_per_row=12)
    assert sum(len(row.samples) for row in plan.rows) == 12 and all(row.samples for row in plan.rows)
    return [batch.micro_batches for batch in collate_step(plan, (), num_processes=num_processes)]


CASES = [LossOptions(loss_type=loss_type) for loss_type in LOSS_TYPES] + [
    LossOptions(loss_type="grpo", importance_sampling_level="sequence", beta=0.04),
    LossOptions(
        loss_type="dr_grpo",
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode="token_truncate",
        vllm_importance_sampling_clip_min=0.5,
    ),
    LossOptions(loss_type="dapo", delta=1.5, off_policy_mask_threshold=0.5, entropy_coef=0.05),
]
#: per-micro-batch quantities (the entropy mask's threshold, its bonus's count): equal across ranks, not micro-batches
ONE_MICRO_BATCH = [LossOptions(loss_type="grpo", top_entropy_quantile=0.5, entropy_coef=0.1)]


@pytest.mark.timeout(240)
def test_one_rank_one_micro_batch_equals_two_gloo_ranks_with_two_micro_batches(tmp_path, no_leaked_processes):
    two_by_two, two_by_one = steps(2, 2), steps(2, 1)
    cases = [(options, two_by_two) for options in CASES] + [(options, two_by_one) for options in ONE_MICRO_BATCH]
    (tmp_path / "cases.pkl").write_bytes(pickle.dumps(cases))
    run_ranks(2, tmp_path, timeout=200, target="helpers.loss_ranks:run_loss_rank")
    ranks = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(2)]

    one = steps(1, 1)[0]
    for index, (options, _) in enumerate(cases):
        expected = step_gradient(one, options)
        assert expected["loss"].abs() > 0
        for rank in ranks:
            got = rank[index]
            assert got.keys() == expected.keys()
            for name, value in expected.items():
                torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-6, msg=f"{options.loss_type}: {name}")


def test_score_step_rewrites_both_normalisers_when_it_masks_samples():
    """Trainer scoring takes samples that carry no gradient out of the loss: the step's token and sequence counts
    (what every loss type divides by) become those of the samples still trained, on every micro-batch."""
    from helpers.tiny import tiny_reward_model

    from lightning_grpo.scoring.builtin_scorers import RewardModelScorer
    from lightning_grpo.scoring.step import score_step

    scorers = [RewardModelScorer(tiny_reward_model(0), name="rm")]
    pending = [
        rollout_group(0, 6, [3, 5, 4, 6], seed=0, rewards=[1, 0, 1, 0], truncated=[False, True, False, False]),
        rollout_group(1, 4, [2, 7, 5, 3], seed=1, rewards=[0, 1, 0, 1]),
    ]
    plan = plan_step(pending, num_processes=1, steps=2, samples_per_row=4, scorers=scorers)
    step = collate_step(plan, scorers, num_processes=1, reward_names=["accuracy"])[0]
    scored = score_step(torch.nn.Linear(1, 1), step, scorers=scorers, mask_truncated_completions=True)
    assert (~scored.trained).sum() >= 1  # the truncated sample left the loss
    tokens = sum(mb["token_index"].numel() for mb in step.micro_batches)
    sequences = sum(int((torch.bincount(mb["segment_id"]) > 0).sum()) for mb in step.micro_batches)
    assert sequences == int(scored.trained.sum()) < 8
    for mb in step.micro_batches:
        assert mb["step_trained_tokens"].item() == tokens and mb["step_sequences"].item() == sequences
