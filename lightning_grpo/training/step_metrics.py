"""One row of metrics per optimizer step, sent once to every attached logger; counters kept as run totals.

Lightning's `self.log(on_step=True)` sends every key logged earlier in the epoch again at each step, with the value
it had when it was last logged (a key keeps its cached value until the epoch ends). Here many keys do not get a value
at every step (a weight push every n steps, the rollout child's measurement windows), so that would log old values
again as if they were new. `StepMetrics` collects one step's metrics instead and hands them to every logger of the
trainer once, through Lightning's logger API (`Logger.log_metrics`), under the step and at the interval Lightning
itself uses (`log_every_n_steps`, and the last step). It still passes each value to `self.log(logger=False)`, so
`trainer.callback_metrics`, the progress bar and `ModelCheckpoint(monitor=...)` see them as usual.

Counters follow TRL's convention: whoever counts pushes increments under a `*_total` name. `StepMetrics` adds them
up, so a logged `*_total` is the run's cumulative count at that step; the totals are part of the module's
checkpoint, so a resumed run's totals carry on from where the checkpoint left them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl

from ..pipeline.metrics import is_counter

__all__ = ["StepMetrics", "is_counter", "log_step_metrics"]


class StepMetrics:
    """This optimizer step's metrics (rank 0), logged once at the step's end; `*_total` increments become totals.

    Owned by `GRPOModule` (`GRPOModule.step_metrics`): the module and the callbacks `add` to it during the step, and
    the module's `on_train_batch_end`, which Lightning calls after every callback's, `flush`es it. NaN values are
    left out (a metric without a value at a step has no entry in that step's row).
    """

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self._row: dict[str, float] = {}

    def add(self, pl_module: pl.LightningModule, metrics: Mapping[str, float]) -> None:
        """Add metrics of this step; a `*_total` value is an increment of that counter. Rank 0's are logged."""
        values = {key: float(value) for key, value in metrics.items() if not math.isnan(float(value))}
        for key, value in values.items():
            if is_counter(key):
                values[key] = self.totals[key] = self.totals.get(key, 0.0) + value
        if not values:
            return
        self._row.update(values)
        # Logger-free: callback_metrics, the progress bar and checkpoint monitors read them; the loggers get `flush`.
        pl_module.log_dict(values, logger=False, on_step=True, on_epoch=False, rank_zero_only=True)

    def flush(self, trainer: pl.Trainer) -> dict[str, float]:
        """Send this step's row to every logger (rank 0, on Lightning's logging steps) and start the next row.

        The row holds every counter's total, so each counter has a value in every logged row. Returns what was sent
        (empty when nothing was).
        """
        row, self._row = self._row, {}
        if not trainer.is_global_zero or not trainer.loggers or not _logs_this_step(trainer):
            return {}
        row = {**self.totals, **row, "epoch": float(trainer.current_epoch)}
        step = max(trainer.global_step - 1, 0)  # Lightning's step of the optimizer step that just ran (0-based)
        for logger in trainer.loggers:
            logger.log_metrics(row, step=step)
            logger.save()
        return row

    def state_dict(self) -> dict[str, Any]:
        return {"totals": dict(self.totals)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.totals = {key: float(value) for key, value in state.get("totals", {}).items()}


def _logs_this_step(trainer: pl.Trainer) -> bool:
    """Lightning's rule for training steps: every `log_every_n_steps`-th optimizer step, and the last one."""
    every = trainer.log_every_n_steps
    return every > 0 and (trainer.global_step % every == 0 or trainer.should_stop)


def log_step_metrics(pl_module: pl.LightningModule, metrics: Mapping[str, float]) -> None:
    """Add `metrics` to the step's row of a module with `step_metrics` (GRPOModule), else `self.log` them."""
    step_metrics = getattr(pl_module, "step_metrics", None)
    if isinstance(step_metrics, StepMetrics):
        step_metrics.add(pl_module, metrics)
    else:
        pl_module.log_dict(dict(metrics), on_step=True, on_epoch=False, rank_zero_only=True)
