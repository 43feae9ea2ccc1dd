"""Logs a table of what the policy wrote: a sample of the step's prompts, completions, rewards and advantages."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_grpo.training.completions import completion_rows, log_completion_rows


class CompletionsTableCallback(Callback):
    """Every `log_completions_every_n_steps` optimizer steps, logs a sample of the step's rollouts as a table.

    TRL's `log_completions=True` with `logging_steps=n` and its `num_completions_to_print`, the Lightning way: the
    interval is this callback's (0 turns it off; the first and the run's last step are logged too), and the rows go to
    every attached logger: `completions.csv` beside a `CSVLogger`'s `metrics.csv`, the text tag `completions` in
    TensorBoard, a `wandb.Table` with `WandbLogger`, the artifact `completions.json` with `MLFlowLogger` (see
    `lightning_grpo.training.completions` for the columns). Unlike TRL, nothing is printed: the console has the
    progress bar.

    Rank 0 only (it has the step's samples), after the step trained, from data the step already holds: the cost is
    building and writing at most `num_completions_to_print` rows on the steps it logs. `GRPOModule` adds one with
    the defaults; put your own in `Trainer(callbacks=...)` to change them.

    Args:
        log_completions_every_n_steps: optimizer steps between tables; 0 never logs one.
        num_completions_to_print: rows per table, taken across the step's groups in turn; None: every sample of the
            step (TRL's default).

    Raises:
        ValueError: a negative interval or a `num_completions_to_print` below 1.

    Example::

        trainer = Trainer(callbacks=[CompletionsTableCallback(log_completions_every_n_steps=5)])
    """

    def __init__(self, log_completions_every_n_steps: int = 10, num_completions_to_print: int | None = None) -> None:
        if log_completions_every_n_steps < 0 or (num_completions_to_print is not None and num_completions_to_print < 1):
            raise ValueError(
                f"`CompletionsTableCallback(log_completions_every_n_steps={log_completions_every_n_steps}, "
                f"num_completions_to_print={num_completions_to_print})`: the interval must be at least 0 (0: off) "
                "and num_completions_to_print at least 1 (or None for every completion of the step)."
            )
        self.log_completions_every_n_steps = log_completions_every_n_steps
        self.num_completions_to_print = num_completions_to_print
        self._policy_version = 0
        self._last: tuple[Any, ...] | None = None  # the last step, until it is logged

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        sync = getattr(trainer.datamodule, "weight_sync", None)
        self._policy_version = sync.version if sync is not None else 0

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not trainer.is_global_zero or self.log_completions_every_n_steps == 0:
            return
        step = trainer.global_step - 1  # the step's row in the metrics (Lightning's 0-based step)
        self._last = (batch, step, self._policy_version, getattr(pl_module, "scored_step", None))
        if self._logs(trainer):
            self._log_last(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The run's last step is always in the table, also when the run ended where no callback could tell."""
        if self._last is not None and trainer.is_global_zero:
            self._log_last(trainer)

    def _logs(self, trainer: pl.Trainer) -> bool:
        step, every = trainer.global_step, self.log_completions_every_n_steps
        return step == 1 or step % every == 0 or trainer.should_stop

    def _log_last(self, trainer: pl.Trainer) -> None:
        last, self._last = self._last, None
        if last is None:
            return
        batch, step, version, scored = last
        rows = completion_rows(
            batch, step=step, policy_version=version, scored=scored, limit=self.num_completions_to_print
        )
        log_completion_rows(trainer, rows, step=step)
