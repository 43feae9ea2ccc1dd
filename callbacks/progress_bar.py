"""A progress bar that shows prompt groups consumed of the run's total, the mean reward and the staleness."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar
from typing_extensions import override

from lightning_grpo.contract import RolloutSource


class GRPOProgressBar(TQDMProgressBar):
    """Lightning's TQDM bar plus `groups` (consumed/total), `reward` and `stale` (mean staleness of the last step).

    The step count alone says little (the stream's length is only a bound: it ends when the groups are consumed);
    the group count is the run's real progress.
    """

    @override
    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        datamodule = trainer.datamodule
        summary = datamodule.progress_summary() if isinstance(datamodule, RolloutSource) else None
        if summary:
            metrics["groups"] = f"{summary['groups_consumed']}/{summary['groups_total']}"
        logged = trainer.callback_metrics
        for key, label in (("reward", "reward"), ("sample/staleness_mean", "stale")):
            if key in logged:
                metrics[label] = f"{float(logged[key]):.3f}"
        return metrics
