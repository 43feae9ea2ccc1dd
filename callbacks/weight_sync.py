"""Pushes the policy's weights to the generator and bumps the model version."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_grpo.pipeline.batch import StepBatch


class WeightSyncCallback(Callback):
    """Pushes the policy's weights to the generator every `every_n_steps` optimizer steps.

    The first push happens in `on_fit_start`, after a checkpoint is restored and before the data module starts
    generating, so a resumed run generates with its restored weights. Each later push bumps `model_version`; samples
    carry the version of the weights that generated them, which is what staleness is measured against.
    `model_version` is saved in checkpoints, so a resumed run never reuses a version number.

    Runs on every rank (gathering sharded weights would be a collective); only rank 0 sends, through the data module's
    weight transfer (shared memory for the embedded generator, HTTP or NCCL for a vLLM server).

    Args:
        every_n_steps: optimizer steps between pushes; staleness grows by one per push, not per step.

    Raises:
        ValueError: if `every_n_steps < 1`.
    """

    def __init__(self, every_n_steps: int = 1) -> None:
        if every_n_steps < 1:
            raise ValueError(f"`WeightSyncCallback(every_n_steps={every_n_steps})` must be at least 1.")
        self.every_n_steps = every_n_steps
        self.model_version = 0

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._push(trainer, pl_module)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if isinstance(batch, StepBatch) and batch.stop:
            return
        if trainer.global_step % self.every_n_steps == 0:
            self.model_version += 1
            self._push(trainer, pl_module)

    def _push(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        datamodule = trainer.datamodule
        if datamodule is None or not hasattr(datamodule, "push_weights"):
            raise RuntimeError("WeightSyncCallback needs a GRPODataModule: pass `datamodule=` to `Trainer.fit`.")
        if trainer.is_global_zero:
            datamodule.push_weights(pl_module.policy_weights(), self.model_version)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"model_version": self.model_version}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.model_version = int(state_dict.get("model_version", 0))
