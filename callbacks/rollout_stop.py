"""Ends training on every rank at the same batch when the rollout stream stops."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_grpo.pipeline.batch import StepBatch


class RolloutStreamError(RuntimeError):
    """The rollout stream ended with an error: the run stalled, or rank 0's pipeline (the rollout child) failed."""


class RolloutStopCallback(Callback):
    """Stops `Trainer.fit` on every rank at the stop item that ends the rollout stream.

    Rank 0's pipeline ends its stream with one stop item that every rank receives at the same batch (see
    `GRPODataModule`). A normal stop (every prompt group consumed) sets `trainer.should_stop` on every rank, so fit
    ends cleanly there, also with `max_epochs=-1`. A stop that carries an error (a full pass over the prompts trained
    nothing, or the rollout child died) raises `RolloutStreamError` with that message on every rank at once, so no
    rank is left waiting in a collective. A stall that trainer scoring completes while the last step trains (its
    groups all excluded) is only known on rank 0 when the stop item arrives; it is broadcast and raised the same way.

    Example::

        trainer = Trainer(callbacks=[RolloutStopCallback(), WeightSyncCallback()])
    """

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not isinstance(batch, StepBatch) or not batch.stop:
            return
        error = batch.error
        if error is None:
            datamodule = trainer.datamodule
            local = datamodule.stall_error() if trainer.is_global_zero and hasattr(datamodule, "stall_error") else None
            error = trainer.strategy.broadcast(local, src=0)
        if error:
            raise RolloutStreamError(error)
        trainer.should_stop = True
