"""Real `GRPODataModule` fits (rollout child, embedded generator) with the GRPO-family options that need one: batch
reward scaling trains TRL's advantages, a truncated sampling distribution gives a unit ratio, and the reference
model with several updates per step ends by itself."""

from __future__ import annotations

import copy
from collections import defaultdict

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from helpers.fit_probe import StepRecorder
from helpers.fit_rewards import char_sum_reward, length_reward
from helpers.tiny import cpu_trainer, tiny_datamodule
from helpers.trl_grpo import generate_and_score, grpo_trainer

from lightning_grpo.module import GRPOModule


def trl_batch_advantages(samples, reward_names, aggregation: str, num_generations: int) -> np.ndarray:
    """TRL's advantages for a step's samples (grouped by group id, in `samples` order) under scale_rewards='batch'."""
    by_group = defaultdict(list)
    for uid, sample in enumerate(samples):
        by_group[sample.group_id].append(uid)
    order = [uid for uids in by_group.values() for uid in uids]
    rewards = np.array([[samples[uid].metrics[f"rewards/{name}"] for name in reward_names] for uid in order])
    trainer = grpo_trainer(
        num_generations=num_generations,
        per_device_train_batch_size=len(order),
        scale_rewards="batch",
        multi_objective_aggregation=aggregation,
        vllm_importance_sampling_correction=False,
    )
    advantages = generate_and_score(trainer, rewards)["advantages"].numpy()
    out = np.empty(len(samples))
    out[order] = advantages
    return out


@pytest.mark.timeout(240)
def test_batch_scaled_rewards_train_trls_advantages_and_a_truncated_sampler_gives_a_unit_ratio(no_leaked_processes):
    """`scale_rewards="batch"` without trainer scorers: the step's advantages are GRPOTrainer's over a batch (here
    GDPO's summed z-scores of two reward columns, scaled by their std over the step; the weighted sum's form goes
    the same way, see `test_advantage_parity.py`); and with `top_k`/`top_p` the trainer's log-probabilities are those
    of the same truncated distribution the generator sampled from, so the first step (trained on the weights that
    generated it) has a ratio of 1."""
    aggregation = "normalize_then_sum"
    recorder = StepRecorder()
    datamodule = tiny_datamodule(
        4,
        reward_funcs=[char_sum_reward, length_reward],
        multi_objective_aggregation=aggregation,
        scale_rewards="batch",
        top_k=20,
        top_p=0.9,
        gradient_accumulation_steps=2,
    )
    trainer = cpu_trainer(callbacks=[recorder])
    trainer.fit(GRPOModule("tiny-random", learning_rate=1e-3), datamodule=datamodule)

    assert recorder.records and trainer.global_step == len(recorder.records)
    for step in recorder.records:
        names = ["char_sum_reward", "length_reward"]
        expected = trl_batch_advantages(step["samples"], names, aggregation, num_generations=4)
        got = np.array([step["advantages"][uid] for uid in range(len(step["samples"]))])
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    first = recorder.records[0]
    assert all(sample.model_version == 0 for sample in first["samples"])  # sampled by the weights it trains
    assert first["metrics"]["ratio"] == pytest.approx(1.0, abs=1e-4), first["metrics"]
    assert first["metrics"]["sampling/sampling_logp_difference/mean"] < 1e-4


@pytest.mark.timeout(240)
def test_reference_model_with_two_updates_per_step_ends_by_itself(no_leaked_processes):
    """`beta > 0` adds a frozen reference; `num_iterations=2` takes two optimizer steps on each planned step, whose
    groups are committed once, with the weights pushed after each step's last update."""
    from lightning_grpo.models import tiny_llama

    recorder = StepRecorder()
    datamodule = tiny_datamodule(4)
    module = GRPOModule("tiny-random", learning_rate=1e-3, beta=0.04, num_iterations=2, loss_type="grpo")
    trainer = cpu_trainer(callbacks=[recorder])
    trainer.fit(module, datamodule=datamodule)

    batches = len(recorder.records)
    assert batches > 0 and trainer.global_step == 2 * batches
    assert [step["global_step"] for step in recorder.records] == [2 * (i + 1) for i in range(batches)]
    assert [step["version"] for step in recorder.records] == list(range(batches))  # one push per planned step
    progress = datamodule.progress
    assert sorted(progress.consumed) == list(range(4))  # every group once, whatever the updates per step
    assert progress.trained_total + sum(progress.dropped.values()) == 4
    assert recorder.records[-1]["metrics"]["kl"] > 0  # the policy moved away from its reference ...
    assert not module.reference.mixed  # ... which never changes without sync_ref_model
    initial = tiny_llama(seed=0)
    for (name, ref), (_, start) in zip(module.reference.named_parameters(), initial.named_parameters(), strict=True):
        assert torch.equal(ref, start), name


class _Bf16Reference(pl.Callback):
    """At the first step: the logprobs of a bf16 copy of the policy (the weights its samples were drawn by, version
    0), teacher-forced on each sample."""

    def __init__(self) -> None:
        self.samples, self.references = [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        from lightning_grpo.rollout.sampling import teacher_forced_logprobs

        if self.samples:
            return
        bf16 = copy.deepcopy(pl_module.policy).to(torch.bfloat16).eval()
        for sample in batch.samples:
            prompt_len = int((sample.completion_mask == 0).sum())
            ids = sample.input_ids.tolist()
            self.samples.append(sample)
            self.references.append(teacher_forced_logprobs(bf16, ids[:prompt_len], ids[prompt_len:], 1.0))


@pytest.mark.timeout(240)
def test_a_bf16_generator_samples_by_bf16_weights_and_the_fp32_trainer_sees_the_mismatch(no_leaked_processes, caplog):
    """`generator_dtype="bfloat16"` beside an fp32 trainer: the child builds its model in bf16 and casts each weight
    sync into it. The first step's samples carry the logprobs of a bf16 forward of the weights that sampled them
    (within bf16's resolution: batched and teacher-forced bf16 products round differently), and the trainer's fp32
    logprobs differ from them by more than an fp32 generator's ever do (< 1e-4, the test above)."""
    recorder, reference = StepRecorder(), _Bf16Reference()
    datamodule = tiny_datamodule(4, generator_dtype="bfloat16")
    trainer = cpu_trainer(callbacks=[recorder, reference])
    with caplog.at_level("INFO", logger="lightning_grpo.pipeline.session"):
        trainer.fit(GRPOModule("tiny-random", learning_rate=1e-3), datamodule=datamodule)

    assert "The embedded generator samples in bfloat16: generator_dtype='bfloat16'." in caplog.text
    assert reference.samples and all(sample.model_version == 0 for sample in reference.samples)
    for sample, expected in zip(reference.samples, reference.references, strict=True):
        prompt_len = int((sample.completion_mask == 0).sum())
        np.testing.assert_allclose(sample.old_log_probs[prompt_len:], expected.numpy(), atol=2e-2)
    assert recorder.records[0]["metrics"]["sampling/sampling_logp_difference/mean"] > 1e-4
    assert trainer.global_step == len(recorder.records) > 0


@pytest.mark.timeout(240)
def test_groups_without_signal_train_when_asked_and_fill_their_steps(no_leaked_processes):
    """`drop_no_signal_groups=False` (GRPOTrainer's behaviour): under a constant reward every group's advantages are
    0, yet every group trains once, in full steps, with its tokens in the loss (the entropy bonus moves the policy);
    the default drops them all and stalls (`test_main_job`'s constant-reward run)."""
    from helpers.fit_rewards import constant_reward

    from lightning_grpo.models import tiny_llama

    recorder = StepRecorder()
    datamodule = tiny_datamodule(8, reward_funcs=[constant_reward], drop_no_signal_groups=False)
    module = GRPOModule("tiny-random", learning_rate=1e-2, entropy_coef=0.1)
    trainer = cpu_trainer(callbacks=[recorder])
    trainer.fit(module, datamodule=datamodule)

    progress = datamodule.progress
    assert progress.trained_total == 8 and not progress.dropped and sorted(progress.consumed) == list(range(8))
    per_step = datamodule.groups_per_step()
    assert [len(groups) for groups in recorder.steps] == [per_step] * (8 // per_step)
    assert all(advantage == 0.0 for step in recorder.records for advantage in step["advantages"].values())
    assert all(step["metrics"]["entropy"] > 0 for step in recorder.records)
    start = dict(tiny_llama(seed=0).named_parameters())
    moved = [name for name, value in module.policy.named_parameters() if not torch.equal(value, start[name])]
    assert moved, "the zero-advantage tokens trained nothing"


@pytest.mark.timeout(240)
def test_dropped_groups_leave_their_places_empty_when_not_replaced(no_leaked_processes):
    """`replace_dropped_groups=False`: the even prompts' groups score alike and are dropped; each step holds two
    places and trains the groups that remain in them (none waits for a replacement; places alone make no step, so
    the first group after them closes it); every group is consumed once and the empty places are logged."""
    from helpers.fit_rewards import signal_on_odd_prompts

    recorder = StepRecorder()
    options = dict(reward_funcs=[signal_on_odd_prompts], samples_per_row=8, replace_dropped_groups=False)
    datamodule = tiny_datamodule(8, **options)
    trainer = cpu_trainer(callbacks=[recorder])
    trainer.fit(GRPOModule("tiny-random", learning_rate=1e-3), datamodule=datamodule)

    progress = datamodule.progress
    assert datamodule.groups_per_step() == 2
    assert progress.dropped == {"no_signal": 4} and progress.trained_total == 4
    assert sorted(progress.consumed) == list(range(8))
    places = [len(groups) + record["metrics"]["batch/empty_places_per_step"] for groups, record in
              zip(recorder.steps, recorder.records, strict=True)]  # fmt: skip
    for place, groups in zip(places[:-1], recorder.steps, strict=False):  # more places: the first group closed it
        assert place == 2 or (place > 2 and len(groups) == 1), (places, recorder.steps)
    assert sum(len(groups) for groups in recorder.steps) == 4 and len(recorder.steps) > 2


@pytest.mark.timeout(240)
def test_replace_early_fit_drops_the_groups_without_signal_and_trains_the_rest_once(no_leaked_processes):
    """`replace_early=True`: the child tags the even prompts' groups (all scored alike) as it scores them and starts
    their replacements then; the trainer drops them, leaves them out of the consumed count it reports, and the fit
    trains every other group once and ends."""
    from helpers.fit_rewards import signal_on_odd_prompts

    recorder = StepRecorder()
    options = dict(reward_funcs=[signal_on_odd_prompts], samples_per_row=8, replace_early=True, max_staleness=1)
    datamodule = tiny_datamodule(8, **options)
    trainer = cpu_trainer(callbacks=[recorder])
    trainer.fit(GRPOModule("tiny-random", learning_rate=1e-3), datamodule=datamodule)

    progress = datamodule.progress
    assert progress.dropped == {"no_signal": 4} and progress.trained_total == 4
    assert sorted(progress.consumed) == list(range(8))
    trained = [g for groups in recorder.steps for g in groups]
    assert len(trained) == len(set(trained)) == 4
