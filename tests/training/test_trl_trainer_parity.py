"""Our GRPO-family loss against a real TRL 1.16 `GRPOTrainer`, trained with `trainer.train()` on the tiny model.

GRPOTrainer is built by its own `__init__` and trains two optimizer steps on one generated batch (`num_iterations=2`,
so the second step's ratio is not 1 and the clip, masks and weights act): it generates, scores, computes advantages,
old and reference log-probabilities, the loss and the backward itself (tests/helpers/trl_grpo.py records each
micro-batch, the weights it ran with, TRL's loss, every gradient and the logged metrics). With the mismatch correction
a generator model stands in for vLLM (it reports its log-probabilities of the sampled tokens) and TRL runs its vLLM
branches.

Our side takes the same tokens as the rollout loop would send them: each completion a `RolloutSample` of its prompt
group, the generator's log-probabilities (TRL's sampling ones; without a generator, the old ones of the policy that
sampled) and our advantages of the same rewards (`compute_group_advantages`, checked equal to TRL's), passed through
the real `SampleFilterQueue` and packed by the real `StepPlanner` and `ProgressCollator` into one micro-batch.
`micro_batch_loss` then runs on a copy of TRL's weights at each step, as `GRPOModule` runs it: the reference's
log-probabilities from our `ReferenceModel` over the packed row, the first update's log-probabilities as the
second's `proximal_log_probs`.

Asserted, in fp32 (both sides; the log-probabilities are float32 on ours): the loss to 1e-5 relative (1e-6 absolute
near 0), every parameter's gradient to 1e-5 of its norm (plus 1e-8 of the whole gradient's), and every metric TRL
logs that we log (`LOSS_METRICS`, `REWARD_METRICS`) present on our side and equal to 1e-5; a metric TRL logs that is
not classified below fails. Each configuration also checks that what it tests acted (`assert_exercised`).
"""

from __future__ import annotations

import math
import queue
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.tiny import collate_step, plan_step
from helpers.trl_grpo import LOSS_METRICS, RecordingGRPOTrainer, char_tokenizer, perturbed, tiny_policy, train_grpo

from lightning_grpo.models import tiny_llama
from lightning_grpo.pipeline.filtering import SampleFilterQueue
from lightning_grpo.rollout.advantages import compute_group_advantages
from lightning_grpo.rollout.records import RolloutSample
from lightning_grpo.training.loss import LossContext, micro_batch_loss
from lightning_grpo.training.loss_options import LossOptions
from lightning_grpo.training.reference import ReferenceModel

NUM_GENERATIONS = 3
PROMPTS_PER_STEP = 2
MAX_COMPLETION_LENGTH = 8
#: end-of-turn ids the tiny policy declares besides <|im_end|>, so that completions end at varied lengths
EOS_TOKEN_IDS = tuple(range(40, 60))
LEARNING_RATE = 0.02
REFERENCE_NOISE = 0.02
GENERATOR_NOISE = 0.02
LOSS_TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
#: each parameter's gradient to this fraction of its norm, plus `GRADIENT_FLOOR` of the whole gradient's norm (a
#: parameter whose gradient is a small sum of cancelling terms carries fp32 noise of the larger terms)
GRADIENT_TOLERANCE = 1e-5
GRADIENT_FLOOR = 1e-8
METRIC_TOLERANCE = {"rel": 1e-5, "abs": 1e-6}

#: GRPOTrainer's metrics that GRPOModule logs from its options (TRL's value, without adaptive entropy, is the option)
OPTION_METRICS = {"entropy_coef"}
#: GRPOTrainer's reward metrics -> ours (the step's, `ProgressCollator.sample_metrics` of the rollout loop's samples)
REWARD_METRICS = {"reward": "reward", "rewards/digit_sum_reward/mean": "rewards/digit_sum_reward"}
#: metrics we log under GRPOTrainer's name that are not measured here, and why
NOT_COMPARED = {
    "reward_std": "ours is TRL's async GRPO's: the mean over samples of their group's std; GRPOTrainer's: the batch's",
    "completions/mean_length": "the rollout loop's, by TRL's async loop code (`_push_rollout_metrics`)",
    "completions/min_length": "the rollout loop's, by TRL's async loop code",
    "completions/max_length": "the rollout loop's, by TRL's async loop code",
    "completions/clipped_ratio": "the rollout loop's, by TRL's async loop code",
}
#: GRPOTrainer's metrics we do not log under its name
NOT_CLAIMED = {
    "grad_norm",
    "learning_rate",  # ours: `lr`
    "epoch",
    "step_time",  # ours: `perf/step_s`
    "num_tokens",  # ours: `batch/*`
    "frac_reward_zero_std",
    "rewards/digit_sum_reward/std",
    "completions/mean_terminated_length",
    "completions/min_terminated_length",
    "completions/max_terminated_length",
}


def digit_sum_reward(completions: list | None, completion_ids: list[list[int]], **kwargs: object) -> list[float]:
    """A deterministic reward of the completion's tokens, varied within a group."""
    return [float(sum(ids) % 7) / 7 for ids in completion_ids]


def one_group_alike(
    completions: list | None, completion_ids: list[list[int]], prompts: list[list[dict]], **kwargs: object
) -> list[float]:
    """`digit_sum_reward`, except that the completions of the call's first prompt (in sorted order) all score 0.5:
    a group without signal, which GRPOTrainer trains with advantages 0."""
    alike = min(prompt[-1]["content"] for prompt in prompts)
    scores = digit_sum_reward(completions, completion_ids)
    return [0.5 if prompt[-1]["content"] == alike else score for prompt, score in zip(prompts, scores, strict=True)]


one_group_alike.__name__ = "digit_sum_reward"  # logged under the same names as `digit_sum_reward`


def train_trl(
    tmp_path: Path, options: dict, reward: Callable = digit_sum_reward
) -> tuple[RecordingGRPOTrainer, torch.nn.Module | None]:
    """GRPOTrainer trained two steps under `options` (GRPOConfig's loss names) with `reward`; returns it and its
    reference."""
    policy = tiny_policy(EOS_TOKEN_IDS)
    reference = perturbed(policy, REFERENCE_NOISE, seed=1) if options.get("beta", 0.0) else None
    correction = options.get("vllm_importance_sampling_correction", False)
    generator = perturbed(policy, GENERATOR_NOISE, seed=2) if correction else None
    trainer = train_grpo(
        tmp_path,
        prompts=2 * PROMPTS_PER_STEP,
        reward_funcs=[reward],
        policy=policy,
        reference=reference,
        generator=generator,
        per_device_train_batch_size=NUM_GENERATIONS * PROMPTS_PER_STEP,
        num_generations=NUM_GENERATIONS,
        max_completion_length=MAX_COMPLETION_LENGTH,
        num_iterations=2,
        max_steps=2,
        learning_rate=LEARNING_RATE,
        **{"vllm_importance_sampling_correction": False, **options},
    )
    return trainer, reference


def our_micro_batch(
    inputs: dict, trainer: RecordingGRPOTrainer, reward: Callable = digit_sum_reward, drop_no_signal_groups: bool = True
) -> tuple[dict, dict]:
    """TRL's trained batch as the rollout loop sends it (scored by `reward`), through the real filter (which may drop
    groups without signal), planned and packed into one micro-batch by the real planner and collator; returns it and
    the step's metrics."""
    prompts, completions, generator_logprobs = unpadded(inputs)
    by_prompt: dict[tuple, list[int]] = {}
    for i, prompt in enumerate(prompts):
        by_prompt.setdefault(tuple(prompt), []).append(i)
    messages = {prompt: [{"role": "user", "content": prompt_content(prompt)}] for prompt in by_prompt}
    step_prompts = [messages[tuple(prompt)] for prompt in prompts]
    step_rewards = reward(None, completions, prompts=step_prompts)  # one call over the step's batch, as TRL's
    groups = []
    for group_id, rows in enumerate(by_prompt.values()):
        columns = np.array([[step_rewards[i] for i in rows]])
        rewards, advantages = compute_group_advantages(
            columns,
            np.ones(1),
            trainer.args.multi_objective_aggregation,
            trainer.args.scale_rewards,
        )
        np.testing.assert_allclose(advantages, inputs["advantages"][rows].numpy(), rtol=1e-5, atol=1e-6)
        groups.append(
            [
                rollout_sample(prompts[i], completions[i], generator_logprobs[i], group_id, float(advantage), metrics)
                for i, advantage, metrics in zip(rows, advantages, reward_metrics(rewards, columns), strict=True)
            ]
        )
    groups = kept_groups(groups, drop_no_signal_groups)
    plan = plan_step(groups, num_processes=1, steps=1, samples_per_row=len(prompts))
    batch = collate_step(plan, (), num_processes=1, reward_names=["digit_sum_reward"])[0]
    assert len(batch.micro_batches) == 1
    return batch.micro_batches[0], batch.metrics


def prompt_content(prompt_ids: tuple[int, ...]) -> str:
    """The user message of a prompt's chat-rendered tokens ("Say 3.")."""
    return re.search(r"Say \d+\.", char_tokenizer().decode(list(prompt_ids))).group()


def kept_groups(groups: list[list[RolloutSample]], drop_no_signal_groups: bool) -> list[list[RolloutSample]]:
    """The groups the rollout filter passes on, in order."""
    source = queue.Queue()
    for group in groups:
        source.put(group)
    filtered = SampleFilterQueue(
        source,
        None,
        model_version=lambda: 0,
        max_staleness=0,
        mask_truncated_completions=False,
        token_budget=0,
        drop_no_signal_groups=drop_no_signal_groups,
    )
    kept = []
    while True:
        try:
            kept.append(filtered.get(timeout=0))
        except queue.Empty:
            return kept


def unpadded(inputs: dict) -> tuple[list[list[int]], list[list[int]], list[list[float]]]:
    """Each row's prompt and completion tokens and the generator's log-probabilities of the completion."""
    generator = inputs.get("sampling_per_token_logps", inputs["old_per_token_logps"])
    prompts, completions, logprobs = [], [], []
    for i in range(inputs["prompt_ids"].shape[0]):
        prompts.append(inputs["prompt_ids"][i][inputs["prompt_mask"][i].bool()].tolist())
        length = int(inputs["completion_mask"][i].sum())
        completions.append(inputs["completion_ids"][i][:length].tolist())
        logprobs.append(generator[i][:length].tolist())
    return prompts, completions, logprobs


def reward_metrics(rewards: np.ndarray, columns: np.ndarray) -> list[dict[str, float]]:
    """Each sample's reward metrics, as `GRPORolloutLoop` sends them."""
    return [
        {"reward": float(r), "rewards/digit_sum_reward": float(c)} for r, c in zip(rewards, columns[0], strict=True)
    ]


def rollout_sample(
    prompt: list[int], completion: list[int], logprobs: list[float], group_id: int, advantage: float, metrics: dict
) -> RolloutSample:
    ids = np.array([*prompt, *completion], dtype=np.int64)
    mask = np.array([0] * len(prompt) + [1] * len(completion), dtype=np.int64)
    old = np.zeros(ids.size, dtype=np.float32)
    old[len(prompt) :] = logprobs
    return RolloutSample(
        prompt="p",
        completion="c",
        input_ids=ids,
        completion_mask=mask,
        old_log_probs=old,
        advantage=advantage,
        model_version=0,
        group_id=group_id,
        metrics=metrics,
        group_rows=NUM_GENERATIONS,
    )


def policy_at(weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    policy = tiny_llama()
    policy.load_state_dict(weights)
    return policy.train()


def assert_gradients_equal(ours: torch.nn.Module, trl: dict[str, torch.Tensor], step: int) -> None:
    names = [name for name, p in ours.named_parameters() if p.requires_grad]
    assert sorted(trl) == sorted(names), f"step {step}: TRL has gradients of {sorted(trl)}"
    total = torch.stack([g.norm() for g in trl.values()]).norm()
    for name, parameter in ours.named_parameters():
        expected = trl[name]
        error = (parameter.grad - expected).norm()
        allowed = GRADIENT_TOLERANCE * expected.norm() + GRADIENT_FLOOR * total
        assert error <= allowed, f"step {step}: {name}'s gradient differs by {error / expected.norm():.2e} of its norm"


def assert_metrics_equal(trl: dict[str, float], ours: dict[str, float], options: LossOptions, step: int) -> None:
    classified = {*LOSS_METRICS, *REWARD_METRICS, *OPTION_METRICS, *NOT_COMPARED, *NOT_CLAIMED}
    unclassified = set(trl) - classified
    assert not unclassified, f"GRPOTrainer logs metrics this test does not classify: {sorted(unclassified)}"
    for name in set(trl) & OPTION_METRICS:
        assert trl[name] == getattr(options, name), (step, name)
    claimed = {**LOSS_METRICS, **REWARD_METRICS}
    for name in sorted(set(trl) & set(claimed)):
        assert claimed[name] in ours, f"step {step}: TRL logs {name!r}, ours has no {claimed[name]!r}"
        expected = math.nan if trl[name] is None else trl[name]
        assert ours[claimed[name]] == pytest.approx(expected, nan_ok=True, **METRIC_TOLERANCE), (step, name)


def compare(
    tmp_path: Path, options: dict, reward: Callable = digit_sum_reward, drop_no_signal_groups: bool = True
) -> RecordingGRPOTrainer:
    """Train TRL, then our loss on each of its steps: loss, every gradient, the metrics both log; returns TRL's
    trainer."""
    trainer, reference = train_trl(tmp_path, options, reward)
    assert len(trainer.records) == 2 and len(trainer.logs) == 2
    first, second = trainer.records
    for key, value in first.inputs.items():  # both updates train the one generated batch
        assert torch.equal(value, second.inputs[key]) if torch.is_tensor(value) else value == second.inputs[key], key
    micro_batch, step_metrics = our_micro_batch(first.inputs, trainer, reward, drop_no_signal_groups)
    our_options = LossOptions(**options)
    context = LossContext(max_completion_length=MAX_COMPLETION_LENGTH, temperature=trainer.temperature)
    if reference is not None:
        micro_batch["ref_log_probs"] = ReferenceModel(reference).logprobs(micro_batch, context)
    per_step = []
    for step, record in enumerate(trainer.records):
        policy = policy_at(record.weights)
        loss, stats, logprobs = micro_batch_loss(policy, micro_batch, our_options, context)
        loss.backward()
        torch.testing.assert_close(loss.detach(), record.loss, **LOSS_TOLERANCE)
        assert_gradients_equal(policy, record.grads, step)
        ours = {**stats.metrics(), **(step_metrics if step == 0 else {})}
        assert_metrics_equal(trainer.logs[step], ours, our_options, step)
        per_step.append(ours)
        micro_batch["proximal_log_probs"] = logprobs  # as GRPOModule: the later update's anchor
    assert_exercised(our_options, per_step, first.inputs.get("importance_sampling_ratio"))
    return trainer


def assert_exercised(options: LossOptions, per_step: list[dict[str, float]], is_ratio: torch.Tensor | None) -> None:
    """The option under test acted on these runs (a clip, mask or bound that nothing crossed would compare nothing)."""
    second = per_step[1]
    if options.loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        assert second["clip_ratio/region_mean"] > 0
    if options.vllm_importance_sampling_correction:
        assert is_ratio is not None
        if options.vllm_importance_sampling_mode.endswith("_mask"):
            assert per_step[0]["sampling/is_masked_frac"] > 0
        else:
            low, high = options.vllm_importance_sampling_clip_min, options.vllm_importance_sampling_clip_max
            assert bool(((is_ratio == low) | (is_ratio == high)).any())
    if options.off_policy_mask_threshold is not None:
        assert second["off_policy/masked_frac"] > 0
    if options.top_entropy_quantile < 1:
        assert second["entropy/masked_frac"] > 0


#: bounds that the generator's ratios cross in these runs (TRL's default `clip_max=3` is not reached by them)
SEQUENCE_BOUNDS = {"vllm_importance_sampling_clip_min": 0.7, "vllm_importance_sampling_clip_max": 1.5}
TOKEN_BOUNDS = {"vllm_importance_sampling_clip_min": 0.8, "vllm_importance_sampling_clip_max": 1.25}


def corrected(mode: str, **options) -> dict:
    bounds = SEQUENCE_BOUNDS if mode.startswith("sequence") else TOKEN_BOUNDS
    return {**options, "vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": mode, **bounds}


FAST = [
    corrected("sequence_mask", loss_type="dapo", beta=0.04),  # TRL's default mode, and the KL
    {"loss_type": "grpo", "importance_sampling_level": "sequence"},  # GSPO
]
SLOW = [
    *[{"loss_type": t} for t in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")],
    {"loss_type": "luspo", "importance_sampling_level": "sequence"},
    {"loss_type": "grpo", "beta": 0.04},
    {"loss_type": "dapo", "beta": 0.04, "use_bias_correction_kl": False},
    *[corrected(mode, loss_type="grpo") for mode in ("token_truncate", "token_mask", "sequence_truncate")],
    corrected("sequence_mask", loss_type="grpo", importance_sampling_level="sequence", beta=0.04),
    corrected("sequence_truncate", loss_type="dr_grpo"),
    corrected("token_mask", loss_type="vespo"),
    corrected("token_truncate", loss_type="cispo", epsilon_high=5.0),
    {"loss_type": "dapo", "epsilon_high": 0.28, "delta": 1.5},
    {"loss_type": "cispo", "epsilon_high": 1.1},
    {"loss_type": "sapo", "sapo_temperature_pos": 2.0, "sapo_temperature_neg": 0.5},
    {"loss_type": "dapo", "off_policy_mask_threshold": 0.05},
    {"loss_type": "dapo", "top_entropy_quantile": 0.4},
    {"loss_type": "grpo", "entropy_coef": 0.1},
]


def _id(options: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in options.items())


@pytest.mark.parametrize("options", FAST, ids=_id)
def test_a_trained_grpo_trainer_step_is_our_loss_and_gradients(tmp_path: Path, options: dict) -> None:
    compare(tmp_path, options)


@pytest.mark.slow
@pytest.mark.parametrize("options", SLOW, ids=_id)
def test_every_loss_configuration_is_a_trained_grpo_trainers(tmp_path: Path, options: dict) -> None:
    compare(tmp_path, options)


def test_a_group_without_signal_trains_as_grpo_trainers_when_not_dropped(tmp_path: Path) -> None:
    """GRPOTrainer trains a group whose completions all scored alike: advantages 0, its tokens in the normaliser, its
    KL term trained. With `drop_no_signal_groups=False` that group passes our rollout filter, and the step's loss,
    gradients and metrics are GRPOTrainer's; by default the filter drops it."""
    trainer = compare(tmp_path, {"loss_type": "dapo", "beta": 0.04}, one_group_alike, drop_no_signal_groups=False)
    inputs = trainer.records[0].inputs
    assert (inputs["advantages"] == 0).sum() == NUM_GENERATIONS  # one whole group, and only it, has no signal
    kept, _ = our_micro_batch(inputs, trainer, one_group_alike, drop_no_signal_groups=False)
    dropped, _ = our_micro_batch(inputs, trainer, one_group_alike, drop_no_signal_groups=True)
    assert kept["sample_uid"].numel() == NUM_GENERATIONS * PROMPTS_PER_STEP
    assert dropped["sample_uid"].numel() == NUM_GENERATIONS * (PROMPTS_PER_STEP - 1)
