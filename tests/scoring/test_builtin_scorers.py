"""Built-in trainer scorers: reward-model scores and EBFT features equal their unpacked per-sequence computation,
the feature-matching reward equals its formula by hand, and both run through score_step."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers.tiny import collate_step, plan_step, rollout_group, tiny_reward_model

from lightning_grpo.models import tiny_llama
from lightning_grpo.rollout.records import RolloutSample
from lightning_grpo.scoring.builtin_scorers import FeatureMatchingScorer, RewardModelScorer
from lightning_grpo.scoring.packing import chunk_inputs
from lightning_grpo.scoring.step import score_step
from lightning_grpo.scoring.trainer_scorer import extra_uid

MODULE = torch.nn.Linear(1, 1)
REFERENCE = [7, 8, 9, 10, 3]


def ebft_groups(num_groups: int = 2) -> list[list[RolloutSample]]:
    """Groups whose samples carry the EBFT payload: the prompt length and the reference answer's ids."""
    return [
        rollout_group(g, 6, [4, 7, 5], seed=g, payload=FeatureMatchingScorer.payload([0] * 6, REFERENCE))
        for g in range(num_groups)
    ]


def features_by_uid(scorer, plan) -> dict[int, torch.Tensor]:
    out = {}
    for rows in plan.micro_batches:
        inputs, _ = scorer.collate(rows, 0)
        for row_inputs in inputs:
            for chunk in chunk_inputs(row_inputs):
                with torch.no_grad():
                    uids, feats = scorer.features(MODULE, chunk)
                out.update({uid: f for uid, f in zip(uids.tolist(), feats, strict=True) if uid != -1})
    return out


def test_feature_matching_reward_matches_hand_computation():
    scorer = FeatureMatchingScorer(tiny_llama(1), alignment_coef=0.7, diversity_coef=0.4)
    phi = F.normalize(torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0], [1.0, 1.0, 0.0]]), dim=-1)
    ref = F.normalize(torch.tensor([[1.0, 2.0, 2.0]]), dim=-1)
    rewards, metrics = scorer.group_rewards(phi, ref)
    for j in range(3):
        cos = float(phi[j] @ ref[0])
        others = [float(phi[j] @ phi[k]) for k in range(3) if k != j]
        assert rewards[j].item() == pytest.approx(2 * 0.7 * cos - 2 * 0.4 * sum(others) / 2, rel=1e-6)
    assert metrics["cfm"] == pytest.approx(float((phi.mean(0) - ref[0]).square().sum()), rel=1e-6)
    assert metrics["alignment"] == pytest.approx(float((phi @ ref[0]).mean()), rel=1e-6)
    nan_rewards, _ = scorer.group_rewards(phi, torch.zeros(0, 3))
    assert torch.isnan(nan_rewards).all()  # no reference: not scored


def test_feature_matching_features_equal_per_sequence_hidden_states():
    scorer = FeatureMatchingScorer(tiny_llama(1), layers=(0.5, 1.0), pooling="mean")
    reference_model = tiny_llama(1)
    groups = ebft_groups()
    plan = plan_step(groups, num_processes=2, steps=1, samples_per_row=3, scorers=[scorer])
    got = features_by_uid(scorer, plan)

    def expected(ids: np.ndarray, start: int) -> torch.Tensor:
        with torch.no_grad():
            hidden = reference_model.base_model(input_ids=torch.from_numpy(ids)[None], output_hidden_states=True)
        pooled = [F.normalize(hidden.hidden_states[i][0, start:].mean(0), dim=-1) for i in (1, 2)]
        return F.normalize(torch.cat(pooled), dim=-1)

    for uid, sample in enumerate(plan.samples):
        assert (got[uid] - expected(sample.input_ids, 6)).abs().max().item() < 1e-5
    for group in groups:
        reference = np.concatenate([group[0].input_ids[:6], REFERENCE])
        assert (got[extra_uid(group[0].group_id, 0)] - expected(reference, 6)).abs().max().item() < 1e-5


def test_reward_model_scores_equal_unpacked_sequence_classification():
    model = tiny_reward_model(2)
    scorer = RewardModelScorer(tiny_reward_model(2), token_budget=16)
    plan = plan_step(ebft_groups(), num_processes=1, steps=2, samples_per_row=3, scorers=[scorer])
    got = features_by_uid(scorer, plan)
    assert sorted(got) == list(range(len(plan.samples)))
    for uid, sample in enumerate(plan.samples):
        with torch.no_grad():
            expected = model(input_ids=torch.from_numpy(sample.input_ids)[None]).logits[0, 0]
        assert got[uid].item() == pytest.approx(expected.item(), abs=1e-5)


def test_feature_matching_scores_a_step_end_to_end():
    scorer = FeatureMatchingScorer(tiny_llama(1))
    groups = ebft_groups(3)
    plan = plan_step(groups, num_processes=1, steps=3, samples_per_row=3, scorers=[scorer])
    scored = score_step(MODULE, collate_step(plan, [scorer], num_processes=1)[0], scorers=[scorer])
    assert scored.reward_names == ["feature_matching"] and scored.group_ids == [0, 1, 2]
    assert np.isfinite(scored.rewards).all() and np.isfinite(scored.advantages).all()
    assert scored.advantages.std() > 0
    for key in ("alignment", "diversity", "cfm"):
        assert math.isfinite(scored.metrics[f"scoring/feature_matching/{key}"])


def test_feature_matching_without_a_reference_payload_raises_with_the_fix():
    scorer = FeatureMatchingScorer(tiny_llama(1))
    with pytest.raises(ValueError, match=r"FeatureMatchingScorer.payload\(prompt_ids, reference_ids\)"):
        scorer.group_extras(rollout_group(0, 4, [2, 3], seed=0))


def test_reward_model_with_its_own_tokenizer_scores_the_text(tokenizer):
    scorer = RewardModelScorer(tiny_reward_model(0), tokenizer)
    text, chat = rollout_group(0, 4, [2], seed=0)[0], rollout_group(1, 4, [2], seed=1)[0]
    text.prompt, text.completion = "2+2=", "4"
    chat.prompt, chat.completion = [{"role": "user", "content": "2+2="}], [{"role": "assistant", "content": "4"}]
    assert scorer._token_ids({"sample": text, "input_ids": text.input_ids}) == tokenizer("2+2=4")["input_ids"]
    expected = tokenizer.apply_chat_template(chat.prompt + chat.completion, tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert list(scorer._token_ids({"sample": chat, "input_ids": chat.input_ids})) == list(expected)


def test_scorer_arguments_are_checked():
    with pytest.raises(ValueError, match=r"layers=\[0, 0.5\]"):
        FeatureMatchingScorer(tiny_llama(1), layers=(0, 0.5))
    with pytest.raises(ValueError, match="pooling='max'"):
        FeatureMatchingScorer(tiny_llama(1), pooling="max")
    with pytest.raises(TypeError, match="sequence-classification"):
        RewardModelScorer(tiny_llama(1))
