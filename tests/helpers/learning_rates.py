"""The learning rate of each optimizer step under an optimizer and its scheduler, stepped as GRPOModule steps them."""

from __future__ import annotations

import torch


def learning_rates(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler, steps: int):
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates
