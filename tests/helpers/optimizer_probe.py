"""A callback that records what each optimizer step trained with: its micro-batches and its gradient norm.

Give it to the command as `--trainer.callbacks+=helpers.optimizer_probe.OptimizerStepProbe` (`tests/` is on
`sys.path`), or to a `Trainer` in Python.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch


class OptimizerStepProbe(pl.Callback):
    """`micro_batches`: each Lightning batch's micro-batch count (this rank's forward/backward passes per optimizer
    step); `gradient_norms`: the policy's gradient norm each optimizer step steps on (after clipping)."""

    def __init__(self) -> None:
        self.micro_batches: list[int] = []
        self.gradient_norms: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.micro_batches.append(len(batch.micro_batches))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self.gradient_norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))
