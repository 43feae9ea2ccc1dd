"""Pushes the policy's weights to the generator after optimizer steps."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_grpo.contract import require_rollout_source
from lightning_grpo.training.step_metrics import log_step_metrics


class WeightSyncCallback(Callback):
    """Pushes the policy's weights to the generator every `every_n_steps` optimizer steps (TRL's `weight_sync_steps`).

    The push and the policy version belong to the data module's `WeightSync`: it streams the full (gathered)
    parameters under the generator's names, initialises the transfer once, publishes each push as the next version
    and carries that version in the checkpoint. The data module also pushes once when training starts, before
    generation begins, so a resumed run generates with its restored weights. Samples carry the version of the weights
    that generated them, which is what staleness is measured against; it grows by one per push, not per step.

    Runs on every rank, because gathering sharded weights is a collective; only rank 0 sends. Logs `weights/version`
    and `perf/weight_sync_s` (TRL's name). Pushes happen after a Lightning batch: with `GRPOModule(num_iterations=k)`
    a batch holds `k` optimizer steps, and the push follows each batch during which a multiple of `every_n_steps`
    was reached.

    Args:
        every_n_steps: optimizer steps between pushes.

    Raises:
        ValueError: if `every_n_steps < 1`.
        TypeError: (in `setup`) the data module does not implement `lightning_grpo.RolloutSource`.

    Example::

        trainer = Trainer(callbacks=[WeightSyncCallback(every_n_steps=2)])
    """

    def __init__(self, every_n_steps: int = 1) -> None:
        if every_n_steps < 1:
            raise ValueError(f"`WeightSyncCallback(every_n_steps={every_n_steps})` must be at least 1.")
        self.every_n_steps = every_n_steps
        self._steps_before_batch = 0

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            require_rollout_source(trainer.datamodule, type(self).__name__)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._steps_before_batch = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step // self.every_n_steps == self._steps_before_batch // self.every_n_steps:
            return
        sync = trainer.datamodule.weight_sync
        version = sync.push(pl_module.policy, wrapped=trainer.model)
        metrics = {"weights/version": float(version), "perf/weight_sync_s": sync.last_push_s}
        if trainer.is_global_zero:
            log_step_metrics(pl_module, metrics)
