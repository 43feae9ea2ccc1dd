"""A progress bar in prompt groups: consumed of the run's total, with its ETA, reward, staleness and drops."""

from __future__ import annotations

import math
import sys
import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm
from typing_extensions import override

from lightning_grpo.contract import RolloutSource


class GRPOProgressBar(TQDMProgressBar):
    """Lightning's TQDM bar counting prompt groups: consumed (trained or dropped) of the run's total.

    A run ends when its prompt groups are consumed, not after a number of batches (an optimizer step trains several
    groups, and a dropped group counts without a step), so the bar's total, its rate and its ETA are in groups.
    Beside it: the step, the mean `reward` and staleness (`stale`) of the last step, and the groups `dropped` so far;
    metrics show 3 significant digits, as in Lightning's bar (`format_metric`).
    A resumed run starts at the groups its checkpoint had consumed, and its rate counts only this run's.

    It shows the state after each optimizer step when the next one starts, and at the end. In a terminal the bar
    updates in place. Without one (output to a file or a pipe, a notebook), it prints a line instead: when the first
    step starts, each time another tenth of the groups is consumed or `line_interval_s` passed since the last line,
    and at the end; and one line per validation with its `val/*` metrics. `GRPOModule`'s command
    (`lightning-grpo`) uses this bar by default.

    Args:
        refresh_rate: update the bar every this many optimizer steps (0 turns it off), as `TQDMProgressBar`.
        process_position: as `TQDMProgressBar`.
        leave: as `TQDMProgressBar`.
        lines: print lines instead of drawing a bar; None: when standard output is not a terminal.
        line_interval_s: in lines mode, the longest wait between two lines while the run makes progress.

    Raises:
        ValueError: a `line_interval_s` that is not positive.

    Example::

        trainer = Trainer(callbacks=[GRPOProgressBar(lines=True, line_interval_s=300)])
    """

    def __init__(
        self,
        refresh_rate: int = 1,
        process_position: int = 0,
        leave: bool = False,
        lines: bool | None = None,
        line_interval_s: float = 60.0,
    ) -> None:
        if not line_interval_s > 0:
            raise ValueError(f"`GRPOProgressBar(line_interval_s={line_interval_s})` must be positive.")
        super().__init__(refresh_rate=refresh_rate, process_position=process_position, leave=leave)
        self.lines = lines if lines is not None else not _is_terminal(sys.stdout)
        self.line_interval_s = line_interval_s
        self.groups_total = 0
        self.groups_consumed = 0
        self._started = (0.0, 0)  # (time, groups consumed) when this run's training started
        self._last_line = (0.0, -1)  # (time, groups consumed) of the last printed line
        self._validation_started = 0.0

    @property
    @override
    def is_enabled(self) -> bool:
        """Whether tqdm bars are drawn (not in lines mode, where the base class creates them disabled)."""
        return super().is_enabled and not self.lines

    @property
    def prints_lines(self) -> bool:
        """Whether this bar prints lines (lines mode, on rank 0, not turned off)."""
        return self.lines and super().is_enabled

    # -- training -------------------------------------------------------------------------------------------------

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._read_summary(trainer)
        self._started = (time.monotonic(), self.groups_consumed)
        self._last_line = (time.monotonic(), -1)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, *_: Any) -> None:
        super().on_train_epoch_start(trainer)
        if self.groups_total:
            bar = self.train_progress_bar
            bar.reset(total=self.groups_total)
            bar.initial = bar.n = self._started[1]
            bar.unit = "group"
            bar.set_description(self.train_description)
            bar.refresh()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # The previous step is complete here: its groups committed, the groups dropped while planning this one
        # counted (the end of a step is seen by this callback before the callbacks that record it).
        self._show(trainer, pl_module)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        pass  # shown at the next step's start, or at the end

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._show(trainer, pl_module, last=True)
        super().on_train_epoch_end(trainer, pl_module)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._show(trainer, pl_module, last=True)
        super().on_train_end(trainer, pl_module)

    def _show(self, trainer: pl.Trainer, pl_module: pl.LightningModule, last: bool = False) -> None:
        self._read_summary(trainer)
        if self.prints_lines:
            if self._line_due(last):
                self._print_line(trainer, pl_module)
        elif self.is_enabled and (last or trainer.global_step % self.refresh_rate == 0):
            self.train_progress_bar.n = self.groups_consumed
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))

    @override
    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        metrics["step"] = trainer.global_step
        logged = trainer.callback_metrics
        for key, label in (("reward", "reward"), ("sample/staleness_mean", "stale")):
            if key in logged:
                metrics[label] = float(logged[key])
        summary = _summary(trainer)
        if summary is not None:
            metrics["dropped"] = summary.get("groups_dropped", 0)
        return {key: format_metric(value) for key, value in metrics.items()}

    def _read_summary(self, trainer: pl.Trainer) -> None:
        summary = _summary(trainer)
        if summary is not None:
            self.groups_total = summary["groups_total"]
            self.groups_consumed = summary["groups_consumed"]

    # -- lines mode -----------------------------------------------------------------------------------------------

    def _line_due(self, last: bool) -> bool:
        last_time, last_groups = self._last_line
        if last_groups < 0 or (last and last_groups != self.groups_consumed):
            return True
        tenth = max(self.groups_total / 10, 1)
        return int(self.groups_consumed // tenth) > int(last_groups // tenth) or (
            time.monotonic() - last_time >= self.line_interval_s and self.groups_consumed > last_groups
        )

    def _print_line(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        now = time.monotonic()
        self._last_line = (now, self.groups_consumed)
        total, done = self.groups_total, self.groups_consumed
        started_at, started_with = self._started
        elapsed = now - started_at
        rate = (done - started_with) / elapsed if elapsed > 0 else 0.0
        eta = Tqdm.format_interval((total - done) / rate) if rate > 0 and total else "?"
        share = f" ({100 * done / total:.0f}%)" if total else ""
        extras = " ".join(f"{key}={value}" for key, value in self.get_metrics(trainer, pl_module).items())
        print(
            f"{self.train_description}: {done}/{total} groups{share} [{Tqdm.format_interval(elapsed)}<{eta}] {extras}",
            flush=True,
        )

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_validation_start(trainer, pl_module)
        self._validation_started = time.monotonic()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if not self.prints_lines or trainer.sanity_checking:
            return
        logged = trainer.callback_metrics
        values = " ".join(f"{k}={format_metric(float(v))}" for k, v in logged.items() if k.startswith("val/"))
        took = Tqdm.format_interval(time.monotonic() - self._validation_started)
        print(f"{self.validation_description} at step {trainer.global_step} [{took}]: {values}", flush=True)


def format_metric(value: Any) -> Any:
    """A float as Lightning's TQDM bar shows it: 3 significant digits, padded (`0.792`, `12.00`, `1.23e+3`); NaN and
    infinities as `nan`, `inf`; anything else unchanged."""
    if not isinstance(value, float):
        return value
    return Tqdm.format_num(value) if math.isfinite(value) else str(value)


def _summary(trainer: pl.Trainer) -> dict[str, int] | None:
    datamodule = trainer.datamodule
    return datamodule.progress_summary() if isinstance(datamodule, RolloutSource) else None


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
