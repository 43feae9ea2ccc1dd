"""GRPO loss on packed rows: equal to a naive per-sample computation (value and gradient), a true token mean over
ranks and micro-batches, masked terms left out, TRL's metrics, and the sampler's truncation on the trainer side."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers.tiny import micro_batch, reference_logprobs, shared_prompt_group

from lightning_grpo.models import tiny_llama
from lightning_grpo.training.loss import grpo_loss, packed_logprobs

EPS, EPS_HIGH, TEMPERATURE = 0.2, 0.28, 0.8


def naive_loss(model, samples: list[dict]) -> torch.Tensor:
    """Token mean over every trained token of every sample, one unpacked forward per sample, term by term."""
    total, count = 0.0, 0
    for s in samples:
        ids = torch.from_numpy(s["input_ids"])
        logp = torch.log_softmax(model(input_ids=ids[None]).logits[0].float() / TEMPERATURE, -1)
        for t in range(1, ids.numel()):
            if s["completion_mask"][t]:
                ratio = torch.exp(logp[t - 1, ids[t]] - float(s["old_log_probs"][t]))
                adv = s["advantage"]
                total = total - torch.minimum(ratio * adv, torch.clamp(ratio, 1 - EPS, 1 + EPS_HIGH) * adv)
                count += 1
    return total / count


def samples_with_spread_ratios(model) -> list[dict]:
    """Two groups whose old logprobs sit around the model's, so ratios fall inside and outside the clip range."""
    samples = shared_prompt_group(9, [6, 4, 8], seed=4) + shared_prompt_group(5, [7, 7], group_id=1, uid0=3, seed=5)
    rng = np.random.default_rng(0)
    with torch.no_grad():
        current, _ = reference_logprobs(model, samples, TEMPERATURE)
    k = 0
    for s in samples:
        trained = np.flatnonzero(s["completion_mask"])
        s["old_log_probs"][trained] = current[k : k + trained.size].numpy() + rng.normal(0, 0.4, trained.size)
        s["advantage"] = float(rng.normal())
        k += trained.size
    return samples


def test_packed_loss_and_gradient_equal_naive_per_sample_reference():
    reference_model, packed_model = tiny_llama(0), tiny_llama(0)
    samples = samples_with_spread_ratios(reference_model)
    mb = micro_batch(samples)

    logprobs, entropy = packed_logprobs(packed_model, mb, TEMPERATURE)
    loss, stats = grpo_loss(
        logprobs,
        mb["old_log_probs"],
        mb["advantages"],
        normalizer=mb["step_trained_tokens"],
        epsilon=EPS,
        epsilon_high=EPS_HIGH,
        segment_id=mb["segment_id"],
        entropy=entropy,
    )
    loss.backward()
    expected = naive_loss(reference_model, samples)
    expected.backward()

    assert loss.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-6)
    assert 0 < stats.metrics()["clip_ratio/region_mean"] < 1  # the comparison covers clipped and unclipped terms
    for (name, got), ref in zip(packed_model.named_parameters(), reference_model.parameters(), strict=True):
        assert torch.allclose(got.grad, ref.grad, atol=1e-6, rtol=1e-4), name
    _, ref_entropy = reference_logprobs(reference_model, samples, TEMPERATURE)
    assert stats.metrics()["entropy"] == pytest.approx(ref_entropy.mean().item(), rel=1e-5)


def test_rank_and_micro_batch_split_with_ddp_averaging_gives_the_step_token_mean():
    torch.manual_seed(0)
    num = 23
    logprobs = -torch.rand(num) * 3
    old, adv = logprobs + 0.3 * torch.randn(num), torch.randn(num)

    def grad_of(indices: list[int], world_size: int) -> torch.Tensor:
        leaf = logprobs.clone().requires_grad_()
        loss, _ = grpo_loss(leaf[indices], old[indices], adv[indices], normalizer=num, world_size=world_size)
        loss.backward()
        return leaf.grad

    one_rank = grad_of(list(range(num)), world_size=1)
    # rank r trains micro-batches [a, b]; its backward passes accumulate, then DDP averages the ranks
    ranks = [[list(range(0, 4)), list(range(4, 12))], [list(range(12, 13)), list(range(13, num))]]
    per_rank = [sum(grad_of(mb, world_size=2) for mb in micro_batches) for micro_batches in ranks]
    ddp = sum(per_rank) / len(ranks)
    assert torch.allclose(ddp, one_rank, atol=1e-7)
    # and that is the gradient of the plain token mean of the clipped objective
    leaf = logprobs.clone().requires_grad_()
    ratio = torch.exp(leaf - old)
    (-torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)).mean().backward()
    assert torch.allclose(one_rank, leaf.grad, atol=1e-7)


def test_nan_advantage_terms_contribute_nothing_and_are_not_counted():
    logprobs = torch.tensor([-1.0, -2.0, -0.5, -1.5], requires_grad=True)
    old = torch.tensor([-1.1, -1.0, -0.4, -1.5])
    adv = torch.tensor([1.0, math.nan, -1.0, math.nan])
    loss, stats = grpo_loss(logprobs, old, adv, normalizer=2)
    loss.backward()
    subset = logprobs.detach()[[0, 2]].requires_grad_()
    expected, _ = grpo_loss(subset, old[[0, 2]], adv[[0, 2]], normalizer=2)
    assert loss.item() == pytest.approx(expected.item())
    assert torch.isfinite(logprobs.grad).all()
    assert logprobs.grad[1] == 0 and logprobs.grad[3] == 0
    assert stats.count("ratio") == 2


def test_stats_match_hand_computation_and_merge_exactly():
    ratios = torch.tensor([0.5, 1.0, 1.5, 0.7, 1.3])
    logprobs = torch.log(ratios)
    adv = torch.tensor([-1.0, 1.0, 1.0, 1.0, -1.0])
    segment = torch.tensor([0, 0, 1, 1, 1])
    _, stats = grpo_loss(logprobs, torch.zeros(5), adv, normalizer=5, epsilon=0.2, segment_id=segment)
    metrics = stats.metrics()
    assert metrics["ratio"] == pytest.approx(ratios.mean().item())
    assert metrics["clip_ratio/low_mean"] == pytest.approx(1 / 5)  # 0.5 with A < 0; 0.7 has A > 0
    assert metrics["clip_ratio/high_mean"] == pytest.approx(1 / 5)  # 1.5 with A > 0; 1.3 has A < 0
    assert metrics["clip_ratio/region_mean"] == pytest.approx(2 / 5)
    assert metrics["clip_ratio/low_min"] == pytest.approx(0.0)  # completion 1 has no low-clipped term
    assert metrics["clip_ratio/high_max"] == pytest.approx(1 / 3)  # completion 1: one of three terms
    difference = logprobs.abs()  # the generator's log-probabilities are 0 here
    assert metrics["sampling/sampling_logp_difference/mean"] == pytest.approx(difference.mean().item())
    assert metrics["sampling/sampling_logp_difference/max"] == pytest.approx(difference.max().item())
    assert metrics["loss"] == pytest.approx(grpo_loss(logprobs, torch.zeros(5), adv, normalizer=5)[0].item())
    assert "kl" not in metrics  # the KL is to a reference model, which needs beta > 0

    first = grpo_loss(logprobs[:2], torch.zeros(2), adv[:2], normalizer=5, segment_id=segment[:2])[1]
    second = grpo_loss(logprobs[2:], torch.zeros(3), adv[2:], normalizer=5, segment_id=segment[2:] - 1)[1]
    merged = first + second
    assert merged.metrics() == pytest.approx(metrics)
    assert merged.from_reduced(merged.sums(), merged.maxima()).metrics() == pytest.approx(metrics)
    empty = grpo_loss(logprobs[:0], torch.zeros(0), adv[:0], normalizer=0, segment_id=segment[:0])[1].metrics()
    assert empty["loss"] == 0 and all(math.isnan(v) for k, v in empty.items() if k != "loss")


def test_epsilon_high_widens_only_the_upper_clip():
    logprobs = torch.log(torch.tensor([1.25])).requires_grad_()
    loss, _ = grpo_loss(logprobs, torch.zeros(1), torch.ones(1), normalizer=1, epsilon=0.2)
    loss.backward()
    assert logprobs.grad.item() == 0.0  # clipped at 1.2: no gradient
    logprobs.grad = None
    loss, _ = grpo_loss(logprobs, torch.zeros(1), torch.ones(1), normalizer=1, epsilon=0.2, epsilon_high=0.3)
    loss.backward()
    assert logprobs.grad.item() == pytest.approx(-1.25)


def test_micro_batch_with_every_term_masked_still_backpropagates_to_every_parameter():
    model = tiny_llama(0)
    mb = micro_batch(shared_prompt_group(6, [3, 4], seed=1))
    for key in ("token_index", "old_log_probs", "advantages", "segment_id"):
        mb[key] = mb[key][:0]
    logprobs, _ = packed_logprobs(model, mb)
    loss, stats = grpo_loss(logprobs, mb["old_log_probs"], mb["advantages"], normalizer=0, world_size=2)
    loss.backward()
    assert loss.item() == 0.0 and stats.count("ratio") == 0
    # DDP all-reduces every parameter's gradient: a rank with nothing to train must still produce them
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_non_positive_temperature_is_rejected():
    mb = micro_batch(shared_prompt_group(4, [2], seed=0))
    with pytest.raises(ValueError, match="temperature=0"):
        packed_logprobs(tiny_llama(0), mb, temperature=0)


def test_under_min_p_top_k_and_top_p_the_trainer_scores_the_samplers_truncated_distribution():
    """The generator reports log-probabilities of the truncated, renormalised distribution (`process_logits`); the
    trainer computes the same, and its entropy is that distribution's, with a finite gradient."""
    from lightning_grpo.rollout.sampling import process_logits

    model = tiny_llama(0)
    samples = shared_prompt_group(5, [4, 6], seed=3)
    mb = micro_batch(samples)
    logprobs, entropy = packed_logprobs(model, mb, TEMPERATURE, top_k=30, top_p=0.8, min_p=0.05, entropy_grad=True)
    full, _ = packed_logprobs(tiny_llama(0), mb, TEMPERATURE)
    assert (logprobs > full).all()  # renormalised over fewer tokens
    scores = _packed_logits(tiny_llama(0), mb) / TEMPERATURE
    expected = process_logits(scores, 1.0, 30, 0.8, min_p=0.05)
    labels = mb["shift_labels"][mb["token_index"]]
    kept = torch.isfinite(expected.gather(1, labels[:, None]).squeeze(1))
    # some labels fall outside this random model's set: they stay in the trainer's (a finite log-probability)
    assert kept.any() and (~kept).any() and torch.isfinite(logprobs).all()
    torch.testing.assert_close(logprobs[kept], expected.gather(1, labels[:, None]).squeeze(1)[kept])
    probs = expected.exp()
    torch.testing.assert_close(
        entropy[kept], -(probs * expected.masked_fill(probs == 0, 0)).sum(-1)[kept], rtol=1e-5, atol=1e-6
    )
    (logprobs.sum() + entropy.sum()).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def _packed_logits(model, mb) -> torch.Tensor:
    from lightning_grpo.training.attention import tree_model_kwargs, use_tree_attention

    use_tree_attention(model)
    with torch.no_grad():
        return model(**tree_model_kwargs(mb), logits_to_keep=mb["token_index"], use_cache=False).logits[0].float()
