"""`GRPOModule.configure_model`, delegated: the policy to train (loaded by name, LoRA adapters, activation
checkpointing), its forward (tree or padded) and MoE loss weight, the reference model of the KL term, and both
sharded as the strategy asks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..models.lora import is_peft_model
from .packing_choice import PackingMode, PackingPath, base_model, choose_packing
from .policy import apply_peft, enable_activation_checkpointing
from .reference import ReferenceModel, ReferencePolicy, adapters_start_at_zero, make_reference
from .router_aux_loss import router_aux_loss_coefficient
from .sharding import shard_policy

if TYPE_CHECKING:
    from lightning.pytorch.strategies import Strategy
    from peft import LoraConfig


def prepare_policy(
    policy: torch.nn.Module | None,
    model_name: str | None,
    dtype: str,
    peft_config: LoraConfig | None,
    gradient_checkpointing: bool,
) -> tuple[Any, bool]:
    """The policy to train, and whether fresh LoRA adapters were added to it.

    `policy` as given, else loaded by `model_name` in `dtype`; wrapped with adapters for `peft_config` unless it has
    them already (a `PeftModel` passed in, or a second call: a fit after a validate); activation checkpointing on
    when asked; in train mode (loaders return eval mode, and Lightning switches to eval and back around validation).
    """
    if policy is None and model_name is not None:
        from ..models.loading import load_policy

        policy = load_policy(model_name, dtype=getattr(torch, dtype))
    if policy is None:
        raise ValueError("`GRPOModule(model=...)` is needed: a model name or path, or an `nn.Module`.")
    fresh_adapters = peft_config is not None and not is_peft_model(policy)
    if fresh_adapters:
        policy = apply_peft(policy, peft_config)
    if gradient_checkpointing:
        enable_activation_checkpointing(policy)
    policy.train()
    return policy, fresh_adapters


def policy_forward(
    policy: torch.nn.Module, packing: PackingMode, router_aux_loss_coef: float | None
) -> tuple[PackingPath, float]:
    """The forward the policy trains on (`choose_packing`, logged) and its MoE load-balancing loss's weight
    (`router_aux_loss_coefficient`: TRL's rule, the config's own weight when None, 0 for a dense model)."""
    config = getattr(base_model(policy), "config", None)
    coefficient = router_aux_loss_coefficient(config, router_aux_loss_coef) if config is not None else 0.0
    return choose_packing(policy, packing), coefficient


def generation_attention(policy: torch.nn.Module) -> str:
    """The attention implementation validation's padded batches use: the policy's as loaded, or `"sdpa"` where it is
    tree attention (training switches the policy to it)."""
    loaded = policy.config._attn_implementation
    return loaded if loaded and not loaded.startswith("tree") else "sdpa"


def prepare_reference(
    reference: ReferencePolicy | None,
    policy: torch.nn.Module,
    beta: float,
    fresh_adapters: bool,
    peft_config: LoraConfig | None,
) -> ReferencePolicy | None:
    """The KL term's reference: none with `beta == 0`; the one already built; else one of `policy` as it is now (the
    initial policy, before a checkpoint is restored), the policy with its adapters disabled where `fresh_adapters`
    start at zero (see `make_reference`)."""
    if beta == 0 or reference is not None:
        return reference
    zero = fresh_adapters and peft_config is not None and adapters_start_at_zero(peft_config)
    return make_reference(policy, adapters_start_at_zero=zero)


def shard_models(strategy: Strategy, policy: torch.nn.Module, reference: ReferencePolicy | None) -> None:
    """Shard the policy and a reference model as `strategy` asks (FSDP2 under `ModelParallelStrategy`, else nothing)."""
    shard_policy(policy, strategy)
    if isinstance(reference, ReferenceModel):
        reference.shard(strategy)
