"""TRL 1.16's `GRPOTrainer` and `RLOOTrainer`, built by their own `__init__` on the tiny model, for the parity tests.

`train_grpo` trains a `RecordingGRPOTrainer` with `trainer.train()` on an in-memory dataset: GRPOTrainer with two
public `transformers.Trainer` hooks wrapped, `compute_loss` (records the batch it trains, the weights it runs with and
TRL's loss) and `training_step` (records every parameter's gradient after TRL's backward), and a callback that keeps
what it logs. TRL generates, scores, computes the old and reference log-probabilities and the loss itself.

GRPOTrainer applies its generator-mismatch correction only with vLLM, which has no CPU build. Given a `generator`
model, the trainer stands in for vLLM: it samples with TRL's own HF-generation path and reports the generator's
log-probabilities of the sampled tokens (as vLLM reports its own), and `use_vllm` is set on the built trainer, so TRL's
vLLM branches run as they do with vLLM: old log-probabilities at generation, the importance-sampling ratio with its
mode and clip bounds, its metrics and its weight in the loss.

The per-formula tests call TRL's code on given numbers, on a real trainer too: `trl_loss` calls `_compute_loss` with a
`LogprobsModel` (whose parameters are the per-token log-probabilities themselves), and `generate_and_score` runs
`_generate_and_score_completions` on given completions, reward columns (read by real reward functions from the rows)
and log-probabilities.

Private TRL names used here, pinned by tests/test_trl_names.py: the methods `_compute_loss`,
`_generate_and_score_completions`, `_generate_single_turn` (GRPOTrainer's and RLOOTrainer's, overridden only to stand
in for vLLM or to return given completions) and the attributes `use_vllm`, `model` (a `LogprobsModel` for one
`generate_and_score` call) and `current_gradient_accumulation_steps` (`Trainer.train` sets it per accumulation
window; `trl_loss` sets it, as it runs outside `train`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOConfig
from trl.trainer.grpo_trainer import GRPOTrainer
from trl.trainer.rloo_config import RLOOConfig
from trl.trainer.rloo_trainer import RLOOTrainer

from lightning_grpo.models import char_tokenizer, tiny_llama

PAD = 0
COMPLETION_TOKEN = 7  # the token of every given completion (a character of the tiny tokenizer)

#: GRPOTrainer's loss metrics (logged by `_compute_loss`, and the mismatch correction's at generation) -> ours
#: (`LossStats.metrics()`, the names `GRPOModule` logs): each one TRL logs must be ours, and equal
LOSS_METRICS = {
    name: name
    for name in (
        "loss",
        "policy_loss",
        "entropy",
        "kl",
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "clip_ratio/region_mean",
        "clip_ratio/low_min",
        "clip_ratio/high_max",
        "cispo_clip_ratio",
        "vespo/phi_seq_mean",
        "sampling/sampling_logp_difference/mean",
        "sampling/sampling_logp_difference/max",
        "sampling/importance_sampling_ratio/min",
        "sampling/importance_sampling_ratio/mean",
        "sampling/importance_sampling_ratio/max",
    )
}


@dataclasses.dataclass
class TrainedMicroBatch:
    """One micro-batch GRPOTrainer trained: `inputs` as `compute_loss` got them (`prompt_ids`, `prompt_mask`,
    `completion_ids`, `completion_mask`, `advantages`, and where TRL computed them `old_per_token_logps`,
    `sampling_per_token_logps`, `ref_per_token_logps`, `importance_sampling_ratio`), the model's `weights` at that
    forward, TRL's `loss`, and the `grads` of every parameter after its backward."""

    inputs: dict[str, Any]
    weights: dict[str, torch.Tensor]
    loss: torch.Tensor
    grads: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


class _LogRecorder(TrainerCallback):
    def __init__(self) -> None:
        self.logs: list[dict[str, float]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kwargs: Any) -> None:
        if logs is not None and "train_runtime" not in logs:  # the run's summary is not a step
            self.logs.append(dict(logs))


class RecordingGRPOTrainer(GRPOTrainer):
    """GRPOTrainer recording each micro-batch it trains (`records`) and each step's logged metrics (`logs`); a
    record's `grads` are the gradients after its backward, that micro-batch's alone with `gradient_accumulation_steps=1`.

    Args:
        generator: stand in for vLLM: report this model's log-probabilities of the sampled tokens.
        completions: return these `(completion_ids, generator_logprobs or None)` instead of generating (the
            per-formula tests).
        *args, **kwargs: GRPOTrainer's.
    """

    def __init__(
        self,
        *args: Any,
        generator: torch.nn.Module | None = None,
        completions: tuple[list[list[int]], list[list[float]] | None] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.records: list[TrainedMicroBatch] = []
        self.generator = generator
        self.completions = completions
        self._log_recorder = _LogRecorder()
        self.add_callback(self._log_recorder)
        if generator is not None:
            self.use_vllm = True  # the completions come with a generator's log-probabilities, as from vLLM

    @property
    def logs(self) -> list[dict[str, float]]:
        """What TRL logged at each optimizer step (`logging_steps=1`)."""
        return self._log_recorder.logs

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | None = None,
    ) -> torch.Tensor:
        weights = {name: value.detach().clone() for name, value in model.state_dict().items()}
        recorded = {key: value.clone() if torch.is_tensor(value) else value for key, value in inputs.items()}
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.records.append(TrainedMicroBatch(recorded, weights, loss.detach().clone()))
        return loss

    def training_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | None = None
    ) -> torch.Tensor:
        loss = super().training_step(model, inputs, num_items_in_batch)
        grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
        self.records[-1].grads = grads
        return loss

    def _generate_single_turn(
        self,
        prompt_ids: list[list[int]],
        images: Any,
        multimodal_fields: dict[str, Any],
        num_generations: int,
        has_tool_images: bool = False,
    ) -> tuple[list[list[int]], list[list[float]] | None]:
        if self.completions is not None:
            return self.completions
        if self.generator is None:
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        self.use_vllm = False  # sample with TRL's HF-generation path
        try:
            completion_ids, _ = super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        finally:
            self.use_vllm = True
        return completion_ids, sampled_logprobs(self.generator, prompt_ids, completion_ids, self.temperature)


class _GivenCompletionsRLOOTrainer(RLOOTrainer):
    """RLOOTrainer returning given completion ids instead of generating (advantage tests)."""

    completions: list[list[int]]

    def _generate_single_turn(
        self, prompt_ids: list[list[int]], images: Any, multimodal_fields: dict
    ) -> list[list[int]]:
        return self.completions


@torch.no_grad()
def sampled_logprobs(
    model: torch.nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    temperature: float,
) -> list[list[float]]:
    """Each completion token's log-probability under `model` at `temperature`, as a sampler reports them."""
    out = []
    for prompt, completion in zip(prompt_ids, completion_ids, strict=True):
        ids = torch.tensor([[*prompt, *completion]])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(completion)[:, None]).squeeze(1)
        out.append(logprobs.tolist())
    return out


def tiny_policy(eos_token_ids: Sequence[int] = (), seed: int = 0) -> torch.nn.Module:
    """The tiny random Llama in fp32; `eos_token_ids` are declared as further end-of-turn ids (GRPOTrainer ends a
    completion at any of them), so that sampled completions end at varied lengths."""
    model = tiny_llama(seed=seed)
    model.generation_config.eos_token_id = [3, *eos_token_ids]
    return model


def perturbed(model: torch.nn.Module, scale: float, seed: int) -> torch.nn.Module:
    """A copy of `model` with Gaussian noise of `scale` added to every parameter (a reference or a generator that
    differs from the policy)."""
    copy_ = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in copy_.parameters():
            parameter.add_(scale * torch.randn(parameter.shape, generator=generator))
    return copy_.eval()


def train_grpo(
    output_dir: Path,
    *,
    prompts: int,
    reward_funcs: list[Callable],
    policy: torch.nn.Module,
    reference: torch.nn.Module | None = None,
    generator: torch.nn.Module | None = None,
    **config: Any,
) -> RecordingGRPOTrainer:
    """`RecordingGRPOTrainer(...).train()` on `prompts` chat prompts of equal length, one process on CPU.

    `config` goes to `GRPOConfig` (over CPU, fp32, no logging backend, no checkpoint, a log every step). With
    `beta > 0`, GRPOTrainer builds its reference model from the policy's `config._name_or_path`: `reference` is
    saved under `output_dir` and the policy's config points there.
    """
    if reference is not None:
        reference.save_pretrained(output_dir / "reference")
        policy.config._name_or_path = str(output_dir / "reference")
    args = GRPOConfig(
        output_dir=str(output_dir / "trl"),
        use_vllm=False,
        use_cpu=True,
        bf16=False,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        gradient_checkpointing=False,
        **config,
    )
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Say {i}."}] for i in range(prompts)]})
    trainer = RecordingGRPOTrainer(
        model=policy,
        processing_class=char_tokenizer(),
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=dataset,
        generator=generator,
    )
    trainer.train()
    return trainer


# -- TRL's code on given numbers (the per-formula tests) -------------------------------------------------------------


class LogprobsModel(torch.nn.Module):
    """A causal LM as TRL's `_get_per_token_logps_and_entropies` calls it, returning fixed per-token numbers.

    `logprobs` and `entropy` are `(B, C)` parameters: the completion tokens' log-probabilities and entropies, right
    padded. The forward returns them at the last `C` positions, as TRL's fused LM head does, so "every parameter's
    gradient" is the gradient with respect to each token's log-probability and entropy.
    """

    def __init__(self, logprobs: torch.Tensor, entropy: torch.Tensor | None = None) -> None:
        super().__init__()
        self.logprobs = torch.nn.Parameter(logprobs.detach().clone().float())
        self.entropy = torch.nn.Parameter((entropy if entropy is not None else torch.ones_like(logprobs)).clone())
        self.is_gradient_checkpointing = False

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        fused_lm_head: bool = True,
        **kwargs: Any,
    ) -> SimpleNamespace:
        batch, length = input_ids.shape
        pad = self.logprobs.new_zeros(batch, length - self.logprobs.shape[1])
        return SimpleNamespace(
            log_probs=torch.cat([pad, self.logprobs], dim=1), entropy=torch.cat([pad, self.entropy], dim=1)
        )


def grpo_trainer(*, trainer_cls: type = GRPOTrainer, **config: Any) -> GRPOTrainer:
    """A `GRPOTrainer` (or `RLOOTrainer`) built by its `__init__` on the tiny model, for TRL's code on given numbers.

    `config` goes to `GRPOConfig` (`RLOOConfig`), with `max_completion_length` 8 unless given; `use_vllm=True` (the
    default here) marks the completions as sampled by a separate engine, so the importance-sampling correction applies
    as it does with vLLM. Its reward function is a placeholder: `generate_and_score` rebuilds the trainer with one per
    reward column.
    """
    config.setdefault("max_completion_length", 8)
    use_vllm = config.pop("use_vllm", True)
    config_cls = RLOOConfig if trainer_cls is RLOOTrainer else GRPOConfig
    args = config_cls(
        output_dir=tempfile.mkdtemp(), report_to=[], bf16=False, use_cpu=True, gradient_checkpointing=False, **config
    )
    return _build(trainer_cls, args, reward_funcs=[_column_reward(0)], use_vllm=use_vllm)


def _build(
    trainer_cls: type, args: Any, *, reward_funcs: list[Callable], use_vllm: bool, completions: Any = None
) -> Any:
    cls = _GivenCompletionsRLOOTrainer if trainer_cls is RLOOTrainer else RecordingGRPOTrainer
    # a placeholder dataset: these trainers never iterate it (generate_and_score passes its rows)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "q"}]]})
    kwargs = {} if cls is _GivenCompletionsRLOOTrainer else {"completions": completions}
    policy = tiny_llama()
    if args.beta != 0:  # GRPOTrainer loads its reference model from where the policy's config says it came from
        policy.config._name_or_path = _saved_tiny_llama()
    trainer = cls(
        model=policy,
        processing_class=char_tokenizer(),
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=dataset,
        **kwargs,
    )
    if cls is _GivenCompletionsRLOOTrainer:
        trainer.completions = completions
    trainer.use_vllm = use_vllm and trainer_cls is not RLOOTrainer
    trainer.model.train()
    return trainer


@functools.cache
def _saved_tiny_llama() -> str:
    path = tempfile.mkdtemp()
    tiny_llama().save_pretrained(path)
    return path


def padded(rows: Sequence[Sequence[float]], value: float = 0.0) -> torch.Tensor:
    """`(B, C)` float32, each row right-padded with `value`."""
    width = max(len(row) for row in rows)
    return torch.tensor([list(row) + [value] * (width - len(row)) for row in rows], dtype=torch.float32)


def completion_mask(lengths: Sequence[int]) -> torch.Tensor:
    return padded([[1.0] * n for n in lengths]).long()


def loss_inputs(
    lengths: Sequence[int],
    advantages: Sequence[float],
    *,
    old: torch.Tensor | None = None,
    sampling: torch.Tensor | None = None,
    ref: torch.Tensor | None = None,
    importance_sampling_ratio: torch.Tensor | None = None,
    num_items_in_batch: float | None = None,
) -> dict:
    """The `inputs` dict `_compute_loss` reads, for completions of `lengths` (prompts of one token)."""
    mask = completion_mask(lengths)
    inputs = {
        "prompt_ids": torch.full((len(lengths), 1), 5),
        "prompt_mask": torch.ones(len(lengths), 1, dtype=torch.long),
        "completion_ids": torch.where(mask.bool(), COMPLETION_TOKEN, PAD),
        "completion_mask": mask,
        "advantages": torch.tensor(advantages, dtype=torch.float32),
        "num_items_in_batch": torch.tensor(float(num_items_in_batch if num_items_in_batch else mask.sum())),
    }
    optional = {
        "old_per_token_logps": old,
        "sampling_per_token_logps": sampling,
        "ref_per_token_logps": ref,
        "importance_sampling_ratio": importance_sampling_ratio,
    }
    inputs.update({key: value for key, value in optional.items() if value is not None})
    return inputs


def trl_loss(trainer: GRPOTrainer, model: LogprobsModel, inputs: dict) -> torch.Tensor:
    """`GRPOTrainer._compute_loss(model, inputs)` in train mode, as in one accumulation window of `train`."""
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    model.train()
    return trainer._compute_loss(model, inputs)


def _column_reward(column: int) -> Callable:
    """A reward function returning column `column` of each row's `reward_columns` (None where NaN: not scored)."""

    def reward(completions: list, reward_columns: list[list[float]], **kwargs: Any) -> list[float | None]:
        return [None if math.isnan(row[column]) else float(row[column]) for row in reward_columns]

    reward.__name__ = f"r{column}"
    return reward


def generate_and_score(
    trainer: GRPOTrainer,
    rewards_per_func: np.ndarray,
    *,
    lengths: Sequence[int] | None = None,
    sampling: Sequence[Sequence[float]] | None = None,
    old: torch.Tensor | None = None,
    reward_weights: Sequence[float] | None = None,
) -> dict:
    """TRL's `_generate_and_score_completions` on given completions, rewards and log-probabilities.

    The trainer is rebuilt from `trainer`'s config (and kind) with one real reward function per column of
    `rewards_per_func` (`(B, num_funcs)`, NaN = not scored, completions in groups of `num_generations`), returning
    it from the rows, and `reward_weights`. The completions are `lengths` tokens long (2 each by default), with the
    generator log-probabilities `sampling`; `old` is what the trainer's policy returns for them (a `LogprobsModel`
    as the trainer's `model` for this call), otherwise the tiny model computes them where TRL needs them.
    """
    rewards = np.asarray(rewards_per_func, dtype=np.float64)
    count, columns = rewards.shape
    lengths = list(lengths or [2] * count)
    is_rloo = isinstance(trainer, RLOOTrainer)
    args = copy.deepcopy(trainer.args)
    args.reward_weights = list(reward_weights) if reward_weights is not None else None
    completion_ids = [[COMPLETION_TOKEN] * n for n in lengths]
    logprobs = [list(row) for row in sampling] if sampling is not None else None
    scorer = _build(
        RLOOTrainer if is_rloo else GRPOTrainer,
        args,
        reward_funcs=[_column_reward(k) for k in range(columns)],
        use_vllm=trainer.use_vllm,
        completions=completion_ids if is_rloo else (completion_ids, logprobs),
    )
    if old is not None:
        scorer.model = LogprobsModel(old).train()
    rows = [{"prompt": [{"role": "user", "content": "q"}], "reward_columns": list(row)} for row in rewards]
    with torch.no_grad():
        return scorer._generate_and_score_completions(rows)
