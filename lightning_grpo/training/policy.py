"""The policy as it trains: LoRA adapters (PEFT), activation checkpointing, what the optimizer trains and what a
checkpoint keeps.

`GRPOModule(peft_config=LoraConfig(...))` wraps the loaded policy with `peft.get_peft_model`: only the adapter tensors
(plus whatever the config trains on purpose: `bias`, `modules_to_save`) require grad, so only they are in the
optimizer (`trainable_parameters`) and in checkpoints (`drop_frozen_weights`). The base weights stay as loaded, bit
for bit. Tree attention and the packed loss run unchanged through the wrapper (it forwards `logits_to_keep` and the
`tree_*` keyword arguments to the base model). A config is checked when the module is built (`check_peft_config`),
against a weightless copy of the policy built from its config, so a target module the policy lacks fails before
anything is loaded, naming the modules it has.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import warnings
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from peft import LoraConfig, PeftModel

#: Key of the policy's description in a checkpoint (`policy_record`), read by `lightning-grpo export`.
CHECKPOINT_KEY = "lightning_grpo_policy"
# Layer types LoRA can adapt, for the list of modules a bad `target_modules` is shown.
_ADAPTABLE = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d)
# The Mamba mixer's layers PEFT refuses to adapt (`peft.tuners.tuners_utils._check_lora_target_modules_mamba`).
_MAMBA_FUSED = ("out_proj", "conv1d")


def trainable_parameters(policy: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters the optimizer updates: those that require grad (with LoRA, the adapters only)."""
    return [param for param in policy.parameters() if param.requires_grad]


def check_peft_config(peft_config: Any, model: str | torch.nn.Module) -> None:
    """Check that `peft_config` is a LoRA config whose target modules exist in the policy `model` names or is.

    A policy given by name is built from its config on the meta device (no weights are read); a module is checked
    through a weightless copy built from its `config`, so it is not modified here.

    Raises:
        TypeError: `peft_config` is not a `peft.LoraConfig`.
        ValueError: no module of the policy matches the config's `target_modules` (or another option PEFT refuses);
            the message lists the modules LoRA could adapt.
    """
    from peft import LoraConfig

    if not isinstance(peft_config, LoraConfig):
        raise TypeError(
            f"`GRPOModule(peft_config={type(peft_config).__name__}(...))`: only LoRA adapters are supported; pass a "
            "`peft.LoraConfig` (in YAML: `class_path: peft.LoraConfig` with `init_args`)."
        )
    skeleton = _meta_policy(model)
    if skeleton is not None:
        apply_peft(skeleton, peft_config, policy_name=_describe(model))


def apply_peft(policy: torch.nn.Module, peft_config: LoraConfig, *, policy_name: str = "the policy") -> PeftModel:
    """`policy` wrapped with LoRA adapters from (a copy of) `peft_config`; only the adapters require grad.

    Raises:
        ValueError: PEFT refused the config (e.g. no module matches `target_modules`); the message lists the modules
            of `policy` that LoRA could adapt.
    """
    try:
        return _wrapped(policy, _fitted_all_linear(policy, peft_config))
    except ValueError as error:
        names = ", ".join(adaptable_module_names(policy))
        raise ValueError(
            f"`GRPOModule(peft_config=LoraConfig(target_modules={_targets(peft_config)!r}))` does not fit "
            f"{policy_name}: {error} Its modules LoRA can adapt are: {names}. Pass some of these as `target_modules` "
            "(e.g. ['q_proj', 'v_proj']), or 'all-linear'."
        ) from error


def _fitted_all_linear(policy: torch.nn.Module, peft_config: LoraConfig) -> LoraConfig:
    """`peft_config`, or for `target_modules="all-linear"` on a Mamba-based policy, the same without the Mamba mixer's
    `out_proj` and `conv1d`: PEFT refuses LoRA on them (its fused kernels read their weights directly, so an adapter
    there would be skipped), so "all-linear" means every other linear layer. Tried on a weightless copy, since a
    refused wrap leaves adapters in the model it was applied to."""
    if peft_config.target_modules != "all-linear":
        return peft_config
    skeleton = _meta_policy(policy)
    if skeleton is None:
        return peft_config
    try:
        _wrapped(skeleton, peft_config)
    except ValueError as error:
        if any(f"'{name}'" in str(error) for name in _MAMBA_FUSED):
            excluded = sorted({*_as_list(peft_config.exclude_modules), *_MAMBA_FUSED})
            return dataclasses.replace(peft_config, exclude_modules=excluded)
    return peft_config


def _wrapped(policy: torch.nn.Module, peft_config: LoraConfig) -> PeftModel:
    from peft import get_peft_model

    with warnings.catch_warnings():
        # PEFT reads transformers' deprecated `is_gradient_checkpointing` while wrapping.
        warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(policy, copy.deepcopy(peft_config))


def _as_list(names: Any) -> list[str]:
    if names is None:
        return []
    return [names] if isinstance(names, str) else list(names)


def adaptable_module_names(model: torch.nn.Module) -> list[str]:
    """The distinct last names of `model`'s modules LoRA can adapt (linear, embedding and conv layers), in order."""
    names: dict[str, None] = {}
    for name, module in model.named_modules():
        if name and isinstance(module, _ADAPTABLE):
            names.setdefault(name.rsplit(".", 1)[-1], None)
    return list(names)


def enable_activation_checkpointing(policy: torch.nn.Module) -> None:
    """Recompute each decoder layer's activations in the backward instead of keeping them (non-reentrant).

    Every keyword argument of a layer's forward (the `tree_*` arguments and the shared tree-attention plan) reaches
    the recomputation too, so tree attention works unchanged; the gradients equal those without checkpointing.

    Raises:
        ValueError: the policy does not support activation checkpointing (a model that is not a transformers one).
    """
    enable = getattr(policy, "activation_checkpointing_enable", None) or getattr(
        policy, "gradient_checkpointing_enable", None
    )
    if enable is None or not getattr(policy, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"`GRPOModule(gradient_checkpointing=True)`: {type(policy).__name__} does not support activation "
            "checkpointing (transformers' decoder models do). Leave `gradient_checkpointing` off for this policy."
        )
    enable({"use_reentrant": False})


# -- checkpoints -------------------------------------------------------------------------------------------------


def drop_frozen_weights(state_dict: dict[str, Any], policy: torch.nn.Module, prefix: str) -> dict[str, Any]:
    """`state_dict` without the policy's frozen parameters (under `prefix`): a LoRA checkpoint keeps the adapters."""
    named = policy.named_parameters(remove_duplicate=False)  # a tied output layer is in the state dict twice
    frozen = {f"{prefix}{name}" for name, param in named if not param.requires_grad}
    return {key: value for key, value in state_dict.items() if key not in frozen}


def missing_trainable_keys(state_dict: dict[str, Any], policy: torch.nn.Module, prefix: str) -> list[str]:
    """The policy's trainable parameters (under `prefix`) that `state_dict` lacks."""
    return [
        f"{prefix}{n}" for n, p in policy.named_parameters() if p.requires_grad and f"{prefix}{n}" not in state_dict
    ]


def policy_record(model_name: str | None, peft_config: LoraConfig | None, dtype: str) -> dict[str, Any]:
    """What a checkpoint says about its policy (plain JSON types): enough for `lightning-grpo export` to rebuild it."""
    return {
        "model": model_name,
        "dtype": dtype,
        "peft_config": peft_config_to_dict(peft_config) if peft_config is not None else None,
    }


def peft_config_to_dict(peft_config: LoraConfig) -> dict[str, Any]:
    """`peft_config` as plain JSON types (sets become sorted lists)."""
    return json.loads(json.dumps(peft_config.to_dict(), default=lambda value: sorted(value)))


def peft_config_from_dict(values: dict[str, Any]) -> LoraConfig:
    """The config `peft_config_to_dict` described."""
    from peft import PeftConfig

    return PeftConfig.from_peft_type(**values)


# -- helpers ------------------------------------------------------------------------------------------------------


def _meta_policy(model: str | torch.nn.Module) -> torch.nn.Module | None:
    """A weightless (meta-device) copy of the policy's architecture, or None for a module without a config."""
    from transformers import AutoModelForCausalLM

    if isinstance(model, torch.nn.Module):
        config = getattr(model, "config", None)
        if config is None:
            return None
    else:
        from ..models.loading import load_policy_config

        config = load_policy_config(model)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(copy.deepcopy(config))


def _describe(model: str | torch.nn.Module) -> str:
    return f"the policy {model!r}" if isinstance(model, str) else f"the policy ({type(model).__name__})"


def _targets(peft_config: LoraConfig) -> Any:
    targets = peft_config.target_modules
    return sorted(targets) if isinstance(targets, set) else targets
