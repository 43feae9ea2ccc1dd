"""Logs what the rollout child measured: generation speed, queue waits, drops by reason, reward-pool faults."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_grpo.contract import RolloutSource


class RolloutMetricsCallback(Callback):
    """Drains the rollout child's metrics after every optimizer step and logs them on rank 0.

    Logged (TRL's names where TRL has them): `rollout/generated_tok_s`, `rollout/score_s`, `rollout/score_wait_s`,
    `rollout/inflight`, `rollout/pacing_wait_s`, `rollout/backpressure_s`, `completions/mean_length`,
    `completions/clipped_ratio`, `reward_pool/{calls,errors,timeouts,restarts}_total`, `reward_pool/busy_s`, and the
    trainer-side `progress/dropped_<reason>_total`, `progress/groups_consumed` and `perf/rollout_wait_s`.
    Counters (`*_total`) are the increments since the last step; gauges are averaged since the last step, rates are
    ratios of sums.
    """

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        datamodule = trainer.datamodule
        if not trainer.is_global_zero or not isinstance(datamodule, RolloutSource):
            return
        metrics = datamodule.rollout_metrics()
        if metrics:
            pl_module.log_dict(metrics, rank_zero_only=True, on_step=True, on_epoch=False)
