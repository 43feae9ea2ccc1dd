"""The GRPO family's loss options, with TRL 1.16 GRPOTrainer's names, defaults and meanings, and their checks.

`LossOptions` is what `grpo_loss`/`policy_loss` read; `GRPOModule` builds it from its own arguments (same names) and
calls `check_options`, which refuses at construction what TRL refuses (with both options named) and what is out of
range, and warns where TRL warns.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Literal, get_args

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
ImportanceSamplingLevel = Literal["token", "sequence"]
ImportanceSamplingMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]

#: Losses that take PPO's clipped objective (`epsilon`, `epsilon_high`, `delta`).
CLIPPED_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
#: Losses normalised by the step's trained tokens (the others by its sequences, `dr_grpo` times a constant).
TOKEN_MEAN_LOSSES = ("bnpo", "dapo", "cispo", "vespo")


@dataclass(frozen=True)
class LossOptions:
    """How one optimizer step's policy loss is formed (see `GRPOModule` for each option's meaning).

    The defaults are GRPOTrainer's, except `vllm_importance_sampling_correction=False`: GRPOTrainer applies its
    correction only when vLLM generates, and recomputes the old log-probabilities with the trainer's weights at
    generation time. Here the generator always runs apart (a stale copy, or vLLM) and the ratio is taken against its
    log-probabilities directly, as TRL's async GRPO does; the correction is an opt-in (see `policy_loss`).

    Example::

        from lightning_grpo import LossOptions

        options = LossOptions(loss_type="grpo", beta=0.04, epsilon_high=0.28)
    """

    loss_type: LossType = "dapo"
    importance_sampling_level: ImportanceSamplingLevel = "token"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    beta: float = 0.0
    use_bias_correction_kl: bool = True
    vllm_importance_sampling_correction: bool = False
    vllm_importance_sampling_mode: ImportanceSamplingMode = "sequence_mask"
    vllm_importance_sampling_clip_min: float | None = None
    vllm_importance_sampling_clip_max: float | None = 3.0
    off_policy_mask_threshold: float | None = None
    top_entropy_quantile: float = 1.0
    entropy_coef: float = 0.0
    sapo_temperature_neg: float = 1.05
    sapo_temperature_pos: float = 1.0
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0

    @property
    def epsilon_upper(self) -> float:
        """`epsilon_high`, defaulting to `epsilon` (as GRPOTrainer does)."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def sequence_ratio(self) -> bool:
        return self.importance_sampling_level == "sequence"

    @property
    def sequence_correction(self) -> bool:
        return self.vllm_importance_sampling_mode.startswith("sequence")

    def problems(self) -> list[str]:
        """Every out-of-range value and refused combination, each naming the options and the fix."""
        problems = _choice_problems(self)
        if not self.epsilon > 0:
            problems.append(f"`epsilon={self.epsilon}` must be positive")
        high = self.epsilon_high
        if high is not None and not high > 0:
            problems.append(f"`epsilon_high={high}` must be positive (or None for `epsilon`)")
        elif high is not None and self.loss_type in CLIPPED_LOSSES and high < self.epsilon:
            problems.append(
                f"`epsilon_high={high}` is below `epsilon={self.epsilon}`: the clip range's upper side would be "
                "narrower than its lower one; DAPO raises it (0.28), leave it None for a symmetric range"
            )
        if self.delta is not None and not self.delta > 1:
            problems.append(f"`delta={self.delta}` caps the ratio and must be above 1 (INTELLECT-2 uses 4)")
        for name in ("beta", "entropy_coef", "off_policy_mask_threshold"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and (value >= 0 or name == "entropy_coef")):
                problems.append(f"`{name}={value}` must be a finite number{'' if name == 'entropy_coef' else ' >= 0'}")
        if not 0 <= self.top_entropy_quantile <= 1:
            problems.append(f"`top_entropy_quantile={self.top_entropy_quantile}` must be in [0, 1]")
        problems += self._correction_problems()
        return problems

    def _correction_problems(self) -> list[str]:
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        problems = []
        if low is not None and high is not None and low >= high:
            problems.append(
                f"`vllm_importance_sampling_clip_min={low}` must be less than `vllm_importance_sampling_clip_max={high}`"
            )
        mode = self.vllm_importance_sampling_mode
        if not self.vllm_importance_sampling_correction:
            return problems
        if mode.endswith("_truncate") and low is None and high is None:
            problems.append(
                f"`vllm_importance_sampling_mode={mode!r}` needs `vllm_importance_sampling_clip_min` or "
                "`vllm_importance_sampling_clip_max` (both are None)"
            )
        if self.loss_type == "vespo" and self.sequence_correction:
            problems.append(
                f"`loss_type='vespo'` takes token-level importance weights: `vllm_importance_sampling_mode={mode!r}` "
                "must be 'token_truncate' or 'token_mask'"
            )
        return problems

    def warnings(self) -> list[str]:
        """What GRPOTrainer warns about (the combination runs, but probably not as meant)."""
        found = []
        if self.loss_type == "luspo" and not self.sequence_ratio:
            found.append("`loss_type='luspo'` is meant for `importance_sampling_level='sequence'` (the LUSPO paper's)")
        if self.loss_type == "vespo" and self.sequence_ratio:
            found.append(
                "`loss_type='vespo'` forms its own sequence-level weights: leave `importance_sampling_level='token'`"
            )
        if self.sequence_ratio and self.loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
            found.append(
                f"`importance_sampling_level='sequence'` with `loss_type={self.loss_type!r}` sums per-token terms, "
                "which weights each sequence by its length; GSPO's setup is `loss_type='grpo'`"
            )
        if self.loss_type == "cispo" and self.epsilon_high is None:
            found.append(
                f"`loss_type='cispo'` caps the ratio at `epsilon_high`, which defaults to `epsilon={self.epsilon}`; "
                "ScaleRL recommends `epsilon_high=5.0`"
            )
        if self.delta is not None and self.loss_type not in CLIPPED_LOSSES:
            found.append(f"`delta={self.delta}` has no effect with `loss_type={self.loss_type!r}`")
        return found


def check_options(
    loss: LossOptions,
    *,
    num_iterations: int = 1,
    sync_ref_model: bool = False,
    ref_model_mixup_alpha: float = 0.6,
    ref_model_sync_steps: int = 512,
    owner: str = "GRPOModule",
) -> None:
    """Raise one `ValueError` listing every problem of these options, then warn (once each) where TRL warns.

    Raises:
        ValueError: `"GRPOModule got invalid options: ..."`, each problem naming the options and the fix.
    """
    problems = loss.problems()
    if num_iterations < 1:
        problems.append(f"`num_iterations={num_iterations}` must be at least 1")
    if sync_ref_model and loss.beta == 0:
        problems.append(
            "`sync_ref_model=True` with `beta=0.0`: without a KL term there is no reference model to synchronise; "
            "set `beta` > 0 or `sync_ref_model=False`"
        )
    if not 0 <= ref_model_mixup_alpha <= 1:
        problems.append(f"`ref_model_mixup_alpha={ref_model_mixup_alpha}` must be in [0, 1]")
    if ref_model_sync_steps < 1:
        problems.append(f"`ref_model_sync_steps={ref_model_sync_steps}` must be at least 1")
    if problems:
        raise ValueError(f"{owner} got invalid options: {'; '.join(problems)}.")
    for message in loss.warnings():
        warnings.warn(f"{owner}: {message}.", UserWarning, stacklevel=3)


def _choice_problems(options: LossOptions) -> list[str]:
    choices = {
        "loss_type": LossType,
        "importance_sampling_level": ImportanceSamplingLevel,
        "vllm_importance_sampling_mode": ImportanceSamplingMode,
    }
    return [
        f"`{name}={getattr(options, name)!r}` is not one of {list(get_args(kind))}"
        for name, kind in choices.items()
        if getattr(options, name) not in get_args(kind)
    ]


@dataclass(frozen=True, slots=True)
class ReferenceSync:
    """TR-DPO: how the reference model follows the policy (it needs `beta > 0`)."""

    sync_ref_model: bool  #: mix the policy into the reference every `ref_model_sync_steps` optimizer steps
    ref_model_mixup_alpha: float  #: `reference = alpha * policy + (1 - alpha) * reference`
    ref_model_sync_steps: int  #: optimizer steps between two mixes


def module_loss_options(
    loss: LossOptions,
    *,
    vllm_importance_sampling_cap: float | None,
    num_iterations: int,
    reference: ReferenceSync,
    lora: bool,
) -> LossOptions:
    """`GRPOModule`'s `loss`, checked with its other options (see `check_options`), with TRL's deprecated
    `vllm_importance_sampling_cap` read as `vllm_importance_sampling_clip_max` (and a FutureWarning).

    Raises:
        ValueError: an invalid option or combination, or `sync_ref_model` with LoRA.
    """
    if vllm_importance_sampling_cap is not None:
        warnings.warn(
            "`GRPOModule(vllm_importance_sampling_cap=...)` is deprecated (as in TRL): use "
            "`vllm_importance_sampling_clip_max`.",
            FutureWarning,
            stacklevel=4,
        )
        loss = dataclasses.replace(loss, vllm_importance_sampling_clip_max=vllm_importance_sampling_cap)
    check_options(
        loss,
        num_iterations=num_iterations,
        sync_ref_model=reference.sync_ref_model,
        ref_model_mixup_alpha=reference.ref_model_mixup_alpha,
        ref_model_sync_steps=reference.ref_model_sync_steps,
    )
    if reference.sync_ref_model and lora:
        raise ValueError(
            "`GRPOModule(sync_ref_model=True)` with a `peft_config`: the reference of a LoRA policy is the policy "
            "with its adapters disabled, which TR-DPO cannot mix into (TRL refuses it too); set "
            "`sync_ref_model=False` or train without LoRA."
        )
    return loss
