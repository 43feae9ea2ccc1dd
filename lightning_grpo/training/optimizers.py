"""The optimizer and learning-rate schedule of `GRPOModule`: AdamW with a linear warm-up unless the user gives
LightningCLI-style callables, and the early checks that make a bad one fail at construction."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn


def check_optimizer_options(
    optimizer: Any,
    lr_scheduler: Any,
    defaults: dict[str, Any],
    *,
    warmup_steps: int,
    max_grad_norm: float | None,
    **adamw: Any,
) -> None:
    """Check the step sizes, warn that AdamW's own options (`adamw`, against their `defaults`) are ignored beside an
    `optimizer`, and build the optimizer and the scheduler once over a stand-in parameter, so that a bad argument of
    theirs fails now rather than inside fit.

    Raises:
        ValueError: a non-positive learning rate or `max_grad_norm`, a negative `warmup_steps`; an optimizer or
            scheduler that cannot be built, or a `ReduceLROnPlateau`.
    """
    learning_rate = adamw["learning_rate"]
    problems = [f"learning_rate={learning_rate}"] if not learning_rate > 0 else []
    if warmup_steps < 0:
        problems.append(f"warmup_steps={warmup_steps}")
    if max_grad_norm is not None and not max_grad_norm > 0:
        problems.append(f"max_grad_norm={max_grad_norm}")
    if problems:
        raise ValueError(
            f"`GRPOModule({', '.join(problems)})`: learning_rate and max_grad_norm must be positive, "
            "warmup_steps at least 0."
        )
    changed = [f"{key}={value}" for key, value in adamw.items() if _plain(value) != _plain(defaults[key])]
    if optimizer is not None and changed:
        rank_zero_warn(
            f"`GRPOModule(optimizer=..., {', '.join(changed)})`: learning_rate, weight_decay and betas configure the "
            "default AdamW only, so they are ignored; the optimizer's own arguments (`init_args` in YAML) apply."
        )
    probe = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    for name, factory, argument in (
        ("optimizer", optimizer, [torch.nn.Parameter(torch.zeros(1))]),
        ("lr_scheduler", lr_scheduler, probe),
    ):
        if factory is None:
            continue
        try:
            built = factory(argument)
        except (TypeError, ValueError) as error:
            raise ValueError(f"`GRPOModule({name}=...)` cannot be built: {type(error).__name__}: {error}") from error
        if isinstance(built, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise ValueError(
                "`GRPOModule(lr_scheduler=ReduceLROnPlateau)` needs a monitored metric at each step; GRPOModule steps "
                "its scheduler once per optimizer step without one. Use a step-based scheduler (CosineAnnealingLR, "
                "LinearLR, OneCycleLR, ...)."
            )


def build_optimizers(
    parameters: Iterable[torch.nn.Parameter],
    *,
    optimizer: Any,
    lr_scheduler: Any,
    learning_rate: float,
    weight_decay: float,
    betas: tuple[float, float],
    warmup_steps: int,
    fused: bool = True,
) -> dict[str, Any]:
    """Lightning's `configure_optimizers` answer: the optimizer over `parameters` and its per-step schedule (the
    warm-up first, then `lr_scheduler` if any, through `SequentialLR`). The default AdamW runs on torch's fused
    kernel when `fused` and the kernel takes the parameters (pass False under a gradient scaler: the fused kernel
    unscales by itself, after the clipping)."""
    parameters = list(parameters)
    if optimizer is not None:
        built = optimizer(parameters)
    else:
        built = _adamw(parameters, fused, lr=learning_rate, weight_decay=weight_decay, betas=tuple(betas))
    schedules = torch.optim.lr_scheduler
    warmup = warmup_steps
    scheduler = schedules.LinearLR(built, start_factor=1 / (warmup + 1), end_factor=1.0, total_iters=warmup)
    if lr_scheduler is not None:
        after = lr_scheduler(built)
        scheduler = schedules.SequentialLR(built, [scheduler, after], milestones=[warmup]) if warmup else after
    return {"optimizer": built, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _adamw(parameters: list[torch.nn.Parameter], fused: bool, **options: Any) -> torch.optim.AdamW:
    """AdamW on torch's fused kernel when `fused` and it takes `parameters` (TRL's default,
    `optim="adamw_torch_fused"`; on a CPU the default is a loop of several whole-tensor passes per parameter, the
    fused kernel makes one), else the default implementation."""
    if not fused:
        return torch.optim.AdamW(parameters, **options)
    try:
        return torch.optim.AdamW(parameters, fused=True, **options)
    except RuntimeError:  # a parameter on a device without the kernel, or not floating point
        return torch.optim.AdamW(parameters, **options)


def _plain(value: Any) -> Any:
    return tuple(value) if isinstance(value, list | tuple) else value
