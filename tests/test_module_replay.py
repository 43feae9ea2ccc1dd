"""`GRPOModule` under a real `Trainer.fit` on replayed steps (`tests/replay.py`: no rollout child): the trainer's
log-probabilities under the sampler's truncation, the reference model, several updates per step, every loss type."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from packed_rows import rollout_group
from replay import fit_replay, planned_steps, tiny_contract

from lightning_grpo.models import tiny_llama
from lightning_grpo.module import GRPOModule
from lightning_grpo.rollout.sampling import process_logits, sample_from_logprobs, teacher_forced_logprobs


class MetricsRecorder:
    """The metrics logged at each optimizer step (a Lightning callback)."""

    def __new__(cls):
        import lightning.pytorch as pl

        class _Recorder(pl.Callback):
            def __init__(self) -> None:
                self.steps: list[dict[str, float]] = []

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
                self.steps.append({k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1})

        return _Recorder()


def sampled_groups(count: int, *, top_k: int = 0, top_p: float = 1.0, seed: int = 0) -> list:
    """Groups of 4 completions the tiny policy samples under `top_k`/`top_p`, with its log-probabilities under the
    truncated distribution (what the embedded generator reports for weights version 0)."""
    policy = tiny_llama(0)
    generator = torch.Generator().manual_seed(seed)
    groups = []
    for g in range(count):
        group = rollout_group(g, 5, [4, 6, 3, 5], seed=seed + g)
        for k, sample in enumerate(group):
            ids = sample.input_ids.tolist()
            for t in range(5, len(ids)):
                with torch.no_grad():
                    logits = policy(input_ids=torch.tensor([ids[:t]])).logits[:, -1]
                ids[t] = int(
                    sample_from_logprobs(process_logits(logits, 1.0, top_k, top_p), torch.rand(1, generator=generator))
                )
            sample.input_ids = np.asarray(ids, dtype=np.int64)
            old = teacher_forced_logprobs(policy, ids[:5], ids[5:], 1.0, top_k, top_p).numpy()
            sample.old_log_probs = np.concatenate([np.zeros(5, np.float32), old]).astype(np.float32)
            sample.advantage = float((-1) ** k) * (0.5 + g)
        groups.append(group)
    return groups


def test_a_truncated_sampling_distribution_is_the_one_the_trainer_scores_so_the_first_ratio_is_one():
    """With `top_k`/`top_p`, the generator's log-probabilities are of the truncated, renormalised distribution. The
    trainer computes its own under the same truncation (from the contract), so an unchanged policy has a ratio of
    exactly 1 instead of the kept probability mass."""
    groups = sampled_groups(2, top_k=20, top_p=0.8)
    steps = [rank[0] for rank in planned_steps([groups])]
    recorder = MetricsRecorder()
    fit_replay(GRPOModule("tiny-random"), steps, tiny_contract(top_k=20, top_p=0.8), callbacks=[recorder])
    assert recorder.steps[0]["ratio"] == pytest.approx(1.0, abs=1e-5)
    assert recorder.steps[0]["sampling/sampling_logp_difference/max"] < 1e-4
