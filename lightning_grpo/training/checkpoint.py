"""What `GRPOModule` adds to a Lightning checkpoint and checks when one is restored: the policy's record for
`lightning-grpo export`, the run's metric totals, a TR-DPO-mixed reference model, and (with LoRA) only the adapters."""

from __future__ import annotations

from typing import Any

from .policy import CHECKPOINT_KEY, drop_frozen_weights, missing_trainable_keys, policy_record
from .reference import ReferenceModel
from .sharding import is_fsdp2

#: Checkpoint key of the reference model, present once `sync_ref_model` mixed it (it is the initial policy before).
REFERENCE_KEY = "grpo_reference_model"
#: Checkpoint key of the run's metric totals (`*_total`).
METRIC_TOTALS_KEY = "grpo_metric_totals"


def save_module_state(module: Any, checkpoint: dict[str, Any], *, dtype: str) -> None:
    """Every rank: describe the policy (loaded in `dtype` when by name), keep the metric totals, add a mixed
    reference; with LoRA, keep the adapters and drop the base weights.

    A sharded (FSDP2) policy's distributed checkpoint keeps the base weights: Lightning's sharded loader asks the
    checkpoint for every tensor of the model, whatever `strict_loading` says.
    """
    checkpoint[CHECKPOINT_KEY] = policy_record(module.model_name, module.peft_config, dtype)
    checkpoint[METRIC_TOTALS_KEY] = module.step_metrics.state_dict()
    if isinstance(module.reference, ReferenceModel) and module.reference.mixed:
        checkpoint[REFERENCE_KEY] = module.reference.state_dict()
    if module.peft_config is not None and module.policy is not None and not is_fsdp2(module.policy):
        checkpoint["state_dict"] = drop_frozen_weights(checkpoint["state_dict"], module.policy, prefix="policy.")


def load_module_state(module: Any, checkpoint: dict[str, Any]) -> None:
    """Restore the metric totals and a mixed reference model.

    Raises:
        ValueError: with LoRA, a checkpoint that lacks this policy's adapters (the base weights are not in it).
    """
    module.step_metrics.load_state_dict(checkpoint.get(METRIC_TOTALS_KEY, {}))
    reference = checkpoint.get(REFERENCE_KEY)
    if reference is not None and isinstance(module.reference, ReferenceModel):
        module.reference.load_state_dict(reference)
    state = checkpoint.get("state_dict")  # none under FSDP2: the strategy loaded every tensor itself, strictly
    if module.peft_config is None or module.policy is None or state is None:
        return
    missing = missing_trainable_keys(state, module.policy, prefix="policy.")
    if missing:
        raise ValueError(
            f"The checkpoint has no {missing[:3]} ({len(missing)} of the policy's adapter tensors are missing): it "
            "was not written by a GRPOModule with this `peft_config`. Resume with the `peft_config` (and model) "
            "it was trained with."
        )
