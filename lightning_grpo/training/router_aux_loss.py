"""The Mixture-of-Experts load-balancing loss (`GRPOModule(router_aux_loss_coef=...)`), as GRPOTrainer adds it.

A model whose config has `output_router_logits` (transformers' MoE models) returns its routers' load-balancing loss
as `aux_loss` when called with `output_router_logits=True`. GRPOTrainer adds `router_aux_loss_coef * aux_loss` to
each micro-batch's loss (over the gradient-accumulation steps), with the coefficient the config declares when the
option is None; this module resolves the coefficient the same way. `output_router_logits` is a forward argument
here, never written into the config, so the generator's copy of the model is unchanged.
"""

from __future__ import annotations

from typing import Any

import torch


def router_aux_loss_coefficient(config: Any, router_aux_loss_coef: float | None) -> float:
    """The load-balancing loss's weight for a model with `config`: `router_aux_loss_coef`, or the config's own
    `router_aux_loss_coef` (0 if it declares none) when None; 0 for a model without router logits.

    Raises:
        ValueError: a nonzero `router_aux_loss_coef` for a model that is not a Mixture-of-Experts model returning its
            router logits (TRL refuses it too).
    """
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    moe = hasattr(text_config, "output_router_logits")
    if router_aux_loss_coef and not moe:
        model_type = getattr(config, "model_type", type(config).__name__)
        raise ValueError(
            f"`GRPOModule(router_aux_loss_coef={router_aux_loss_coef})`: the policy (model_type={model_type!r}) is "
            "not a Mixture-of-Experts model that returns its router logits, so there is no auxiliary loss to weight. "
            "Leave `router_aux_loss_coef` at None or 0."
        )
    if not moe:
        return 0.0
    if router_aux_loss_coef is None:
        return float(getattr(text_config, "router_aux_loss_coef", 0.0) or 0.0)
    return float(router_aux_loss_coef)


def check_router_aux_loss_coef(model: str | torch.nn.Module, router_aux_loss_coef: float | None) -> None:
    """Refuse a nonzero `router_aux_loss_coef` for a policy without router logits when the module is built (the
    config of a policy given by name is read, not its weights).

    Raises:
        ValueError: see `router_aux_loss_coefficient`.
    """
    if not router_aux_loss_coef:
        return
    if isinstance(model, torch.nn.Module):
        config = getattr(model, "config", None)
        if config is None:
            raise ValueError(
                f"`GRPOModule(router_aux_loss_coef={router_aux_loss_coef})` needs a transformers model with a config; "
                f"{type(model).__name__} has none."
            )
    else:
        from ..models.loading import load_policy_config

        config = load_policy_config(model)
    router_aux_loss_coefficient(config, router_aux_loss_coef)
