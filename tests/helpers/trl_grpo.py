"""TRL 1.16's own GRPO code, called on given inputs: the loss of `GRPOTrainer._compute_loss` and the advantage and
importance-sampling blocks of `GRPOTrainer._generate_and_score_completions` (and `RLOOTrainer`'s advantages).

A trainer is built without its heavy `__init__` (`object.__new__`), with a real `GRPOConfig` (TRL's defaults), a
real one-process `accelerate.Accelerator` and the attributes those methods read. The policy is `LogprobsModel`: its
parameters are the per-token log-probabilities (and entropies) themselves, so TRL's forward returns exactly the
numbers given, and "every parameter's gradient" is the gradient with respect to each token's log-probability.
Generation and reward functions are replaced by the given completions, sampling log-probabilities and reward
columns: what these tests compare is what TRL does with them.
"""

from __future__ import annotations

import tempfile
from collections import defaultdict, deque
from collections.abc import Sequence
from types import SimpleNamespace

import numpy as np
import torch
from accelerate import Accelerator
from trl import GRPOConfig
from trl.trainer.grpo_trainer import GRPOTrainer
from trl.trainer.rloo_config import RLOOConfig
from trl.trainer.rloo_trainer import RLOOTrainer

PAD = 0


#: the trainer attributes `GRPOTrainer.__init__` copies from its config (tests/test_trl_names.py pins them)
CONFIG_ATTRIBUTES = [
    "beta",
    "loss_type",
    "importance_sampling_level",
    "off_policy_mask_threshold",
    "top_entropy_quantile",
    "entropy_coef",
    "use_adaptive_entropy",
    "num_iterations",
    "max_completion_length",
    "vllm_importance_sampling_correction",
    "vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_min",
    "vllm_importance_sampling_clip_max",
    "scale_rewards",
    "multi_objective_aggregation",
    "num_generations",
    "mask_truncated_completions",
]


class LogprobsModel(torch.nn.Module):
    """A causal LM as TRL's `_get_per_token_logps_and_entropies` calls it, returning fixed per-token numbers.

    `logprobs` and `entropy` are `(B, C)` parameters: the completion tokens' log-probabilities and entropies, right
    padded. The forward returns them at the last `C` positions, as TRL's fused LM head does.
    """

    def __init__(self, logprobs: torch.Tensor, entropy: torch.Tensor | None = None) -> None:
        super().__init__()
        self.logprobs = torch.nn.Parameter(logprobs.detach().clone().float())
        self.entropy = torch.nn.Parameter((entropy if entropy is not None else torch.ones_like(logprobs)).clone())
        self.is_gradient_checkpointing = False

    def forward(self, input_ids, attention_mask=None, labels=None, fused_lm_head=True, **kwargs):
        batch, length = input_ids.shape
        pad = self.logprobs.new_zeros(batch, length - self.logprobs.shape[1])
        return SimpleNamespace(
            log_probs=torch.cat([pad, self.logprobs], dim=1), entropy=torch.cat([pad, self.entropy], dim=1)
        )


def grpo_trainer(model: torch.nn.Module | None = None, *, ref_model=None, trainer_cls=GRPOTrainer, **config):
    """A `GRPOTrainer` (or `RLOOTrainer`) with what `_compute_loss` and `_generate_and_score_completions` read.

    `config` goes to `GRPOConfig` (`RLOOConfig`); `use_vllm=True` marks the completions as sampled by a separate
    engine, so the importance-sampling correction applies as it does with vLLM.
    """
    config_cls = RLOOConfig if trainer_cls is RLOOTrainer else GRPOConfig
    use_vllm = config.pop("use_vllm", True)
    args = config_cls(output_dir=tempfile.mkdtemp(), report_to=[], bf16=False, use_cpu=True, **config)
    trainer = object.__new__(trainer_cls)
    trainer.args = args
    trainer.accelerator = Accelerator(cpu=True)
    trainer.model = model if model is not None else LogprobsModel(torch.zeros(1, 1))
    trainer.ref_model = ref_model
    for name in CONFIG_ATTRIBUTES:
        if hasattr(args, name):
            setattr(trainer, name, getattr(args, name))
    trainer.use_vllm = use_vllm
    trainer.epsilon_low = args.epsilon
    trainer.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    trainer.aux_loss_enabled = False
    trainer._entropy_bonus_enabled = getattr(args, "entropy_coef", 0.0) != 0.0
    trainer._last_world_entropy = float("inf")
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    trainer._logs = {
        "images": deque(),
        "prompt": deque(),
        "completion": deque(),
        "rewards": defaultdict(deque),
        "advantages": deque(),
        "extra": defaultdict(deque),
    }
    trainer._pending_extra_logs = defaultdict(list)
    trainer._pending_metrics = defaultdict(list)
    trainer.log_multimodal = False
    trainer.environment_factories = None
    trainer.environments = None
    trainer.tools = None
    trainer.pad_to_multiple_of = None
    trainer.eos_token_ids = [1]
    trainer._tokenizer = SimpleNamespace(pad_token_id=PAD)
    trainer.normalize_advantages = getattr(args, "normalize_advantages", False)
    trainer.reward_clip_range = getattr(args, "reward_clip_range", None)
    return trainer


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
        "completion_ids": torch.where(mask.bool(), 7, PAD),
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
    """`GRPOTrainer._compute_loss(model, inputs)` in train mode."""
    trainer.model = model
    model.train()
    return trainer._compute_loss(model, inputs)


def generate_and_score(
    trainer: GRPOTrainer,
    rewards_per_func: np.ndarray,
    *,
    lengths: Sequence[int] | None = None,
    sampling: Sequence[Sequence[float]] | None = None,
    old: torch.Tensor | None = None,
    ref: torch.Tensor | None = None,
    reward_weights: Sequence[float] | None = None,
) -> dict:
    """`_generate_and_score_completions` on completions already generated and scored.

    `rewards_per_func` is `(B, num_funcs)` with NaN = not scored, completions in groups of `num_generations`;
    `sampling` the engine's log-probabilities, `old` and `ref` what the trainer's policy and reference models
    return for them (`LogprobsModel`s).
    """
    rewards = torch.as_tensor(np.asarray(rewards_per_func, dtype=np.float32))
    count = rewards.shape[0]
    lengths = list(lengths or [2] * count)
    trainer.reward_funcs = [None] * rewards.shape[1]
    trainer.reward_func_names = [f"r{i}" for i in range(rewards.shape[1])]
    trainer.reward_weights = torch.tensor(reward_weights or [1.0] * rewards.shape[1], dtype=torch.float32)
    completion_ids = [[7] * n for n in lengths]
    completions = [[{"role": "assistant", "content": "x"}]] * count
    if isinstance(trainer, RLOOTrainer):
        trainer._generate = lambda prompts: ([[5]] * count, completion_ids, completions)
    else:
        logprobs = [list(row) for row in sampling] if sampling is not None else None
        trainer._generate = lambda prompts: ([[5]] * count, completion_ids, None, completions, logprobs, {}, None, [])
    trainer._calculate_rewards = lambda *args: rewards.clone()
    trainer.model = LogprobsModel(old if old is not None else torch.zeros(count, max(lengths)))
    if ref is not None:
        trainer.ref_model = LogprobsModel(ref)
    trainer.model.train()
    with torch.no_grad():
        return trainer._generate_and_score_completions([{"prompt": [{"role": "user", "content": "q"}]}] * count)
