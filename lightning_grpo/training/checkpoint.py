"""What `GRPOModule` adds to a Lightning checkpoint and checks when one is restored: the policy's record for
`lightning-grpo export`, the run's metric totals, a TR-DPO-mixed reference model, and (with LoRA) only the adapters."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .policy import CHECKPOINT_KEY, drop_frozen_weights, missing_trainable_keys
from .reference import ReferenceModel, ReferencePolicy
from .sharding import is_fsdp2

if TYPE_CHECKING:
    import torch

#: Checkpoint key of the reference model, present once `sync_ref_model` mixed it (it is the initial policy before).
REFERENCE_KEY = "grpo_reference_model"
#: Checkpoint key of the run's metric totals (`*_total`).
METRIC_TOTALS_KEY = "grpo_metric_totals"


def save_module_state(
    checkpoint: dict[str, Any],
    record: dict[str, Any],
    policy: torch.nn.Module | None,
    reference: ReferencePolicy | None,
    metric_totals: dict[str, Any],
) -> None:
    """Every rank: add the policy's `record` (`policy_record`), the metric totals (`StepMetrics.state_dict()`) and a
    mixed reference; with LoRA (a record with a `peft_config`), keep the adapters and drop the base weights.

    A sharded (FSDP2) policy's distributed checkpoint keeps the base weights: Lightning's sharded loader asks the
    checkpoint for every tensor of the model, whatever `strict_loading` says.
    """
    checkpoint[CHECKPOINT_KEY] = record
    checkpoint[METRIC_TOTALS_KEY] = metric_totals
    if isinstance(reference, ReferenceModel) and reference.mixed:
        checkpoint[REFERENCE_KEY] = reference.state_dict()
    if record["peft_config"] is not None and policy is not None and not is_fsdp2(policy):
        checkpoint["state_dict"] = drop_frozen_weights(checkpoint["state_dict"], policy, prefix="policy.")


def load_module_state(
    checkpoint: dict[str, Any], policy: torch.nn.Module | None, reference: ReferencePolicy | None, *, lora: bool
) -> dict[str, Any]:
    """Restore a mixed reference model, and return the metric totals' state (for `StepMetrics.load_state_dict`).

    Raises:
        ValueError: with `lora`, a checkpoint that lacks the policy's adapters (the base weights are not in it).
    """
    saved_reference = checkpoint.get(REFERENCE_KEY)
    if saved_reference is not None and isinstance(reference, ReferenceModel):
        reference.load_state_dict(saved_reference)
    state = checkpoint.get("state_dict")  # none under FSDP2: the strategy loaded every tensor itself, strictly
    if lora and policy is not None and state is not None:
        missing = missing_trainable_keys(state, policy, prefix="policy.")
        if missing:
            raise ValueError(
                f"The checkpoint has no {missing[:3]} ({len(missing)} of the policy's adapter tensors are missing): "
                "it was not written by a GRPOModule with this `peft_config`. Resume with the `peft_config` (and "
                "model) it was trained with."
            )
    return checkpoint.get(METRIC_TOTALS_KEY, {})
