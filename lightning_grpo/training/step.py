"""`GRPOModule`'s training step, delegated: the step's micro-batches on the device with the reference's
log-probabilities, TR-DPO's reference mixing, and the step's metrics row. The forward, backward and optimizer step stay
in the module (they are Lightning's manual-optimization calls)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch

from ..pipeline.batch import MicroBatch, StepBatch
from .loss import LossContext
from .loss_options import ReferenceSync
from .loss_stats import LossStats, metrics_over_ranks
from .packing_choice import PackingPath
from .reference import ReferenceModel, ReferencePolicy

if TYPE_CHECKING:
    from ..contract import RolloutContract


def step_inputs(
    batch: StepBatch,
    device: torch.device,
    contract: RolloutContract,
    world_size: int,
    reference: ReferencePolicy | None,
    forward: tuple[PackingPath, float] | None = None,
) -> tuple[list[MicroBatch], LossContext]:
    """Every rank: this rank's micro-batches of `batch` on `device`, each with its `ref_log_probs` under the reference
    (once per planned step, as GRPOTrainer computes them once per generation; none with `beta=0`), and the step's
    `LossContext` under the rollouts' `contract` and `forward`: the policy's forward and MoE loss weight
    (`lightning_grpo.training.model_setup.policy_forward`; None: the tree forward, no MoE loss)."""
    packing, router_aux_loss_coef = forward or ("tree", 0.0)
    micro_batches = [
        {k: v.to(device) if torch.is_tensor(v) else v for k, v in mb.items()} for mb in batch.micro_batches
    ]
    context = LossContext.for_step(
        contract, world_size, len(micro_batches), packing=packing, router_aux_loss_coef=router_aux_loss_coef
    )
    if reference is not None:
        for micro_batch in micro_batches:
            micro_batch["ref_log_probs"] = reference.logprobs(micro_batch, context)
    return micro_batches, context


def sync_reference(
    reference: ReferencePolicy | None,
    policy: torch.nn.Module,
    wrapped: torch.nn.Module,
    sync: ReferenceSync,
    global_step: int,
) -> None:
    """TR-DPO: after every `ref_model_sync_steps`-th optimizer step, mix the policy into the reference, as GRPOTrainer's
    `SyncRefModelCallback`. Every rank (gathering a sharded policy's parameters from `wrapped` is a collective)."""
    if not sync.sync_ref_model or global_step % sync.ref_model_sync_steps:
        return
    if not isinstance(reference, ReferenceModel):  # TR-DPO is refused with LoRA: always a model here
        return
    from ..weights.parameters import full_parameters

    with full_parameters(wrapped):
        reference.mix(policy, sync.ref_model_mixup_alpha)


def step_row(
    stats: LossStats,
    iterations: int,
    trainer: pl.Trainer,
    entropy_coef: float,
    lr: float,
    fwd_bwd_s: float,
    step_s: float | None,
) -> dict[str, float]:
    """Every rank (the loss statistics are reduced over the trainer's ranks): the metrics of one planned step's
    `iterations` optimizer steps; `loss` and `policy_loss` are their mean over the updates, `lr` the rate the step
    trained with, `perf/step_s` the time since the previous step ended (None: the first step)."""
    metrics = metrics_over_ranks(stats, trainer.strategy, trainer.world_size)
    for total in ("loss", "policy_loss"):
        if total in metrics:
            metrics[total] /= iterations
    if entropy_coef != 0:
        metrics["entropy_coef"] = entropy_coef
    metrics["lr"] = lr
    metrics["perf/fwd_bwd_s"] = fwd_bwd_s
    if step_s is not None:
        metrics["perf/step_s"] = step_s
    return metrics


def numeric_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The entries of `metrics` that are numbers (bools and text left out)."""
    return {k: v for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)}


def max_steps_reached(trainer: pl.Trainer) -> bool:
    """Whether the trainer reached `Trainer(max_steps=...)` (a planned step's later updates are then skipped)."""
    return trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps
