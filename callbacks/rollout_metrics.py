"""Logs what the rollout child measured: generation speed, queue waits, drops by reason, reward-pool faults."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_grpo.contract import RolloutSource
from lightning_grpo.training.step_metrics import log_step_metrics


class RolloutMetricsCallback(Callback):
    """Drains the rollout side's metrics after every optimizer step and logs them on rank 0.

    Logged (TRL's names where TRL has them): `rollout/generated_tok_s`, `rollout/score_s`, `rollout/score_wait_s`,
    `rollout/inflight`, `rollout/pacing_wait_s`, `rollout/backpressure_s`, `completions/mean_length`,
    `completions/clipped_ratio`, `reward_pool/{calls,errors,timeouts,restarts}_total`, `reward_pool/busy_s`, and the
    trainer-side `progress/dropped_<reason>_total` and `progress/groups_consumed` (groups trained in finished steps
    or dropped). Counters (`*_total`) are the run's totals at that step (restored on resume, see
    `lightning_grpo.training.step_metrics`); gauges are averaged over the window since the last step, rates are ratios of sums.
    It runs after `RolloutStopCallback` (`GRPOModule` adds both in that order), so the groups dropped while the next
    step was planned, and the rollout child's counts up to then, are in this step's row; at the last step, that is
    the whole run.

    Example::

        import lightning.pytorch as pl
        from lightning.pytorch.loggers import CSVLogger

        from lightning_grpo.callbacks import RolloutMetricsCallback

        # GRPOModule adds it when the trainer lacks one; every logger of the trainer
        # gets its metrics
        trainer = pl.Trainer(logger=CSVLogger("logs"), callbacks=[RolloutMetricsCallback()])
    """

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        datamodule = trainer.datamodule
        if not trainer.is_global_zero or not isinstance(datamodule, RolloutSource):
            return
        log_step_metrics(pl_module, datamodule.rollout_metrics())
