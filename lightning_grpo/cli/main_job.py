"""The main job: held-out accuracy before training, a GRPO fit, held-out accuracy after, and a reward plot.

    python -m lightning_grpo.cli.main_job                                   # configs/arithmetic.yaml
    python -m lightning_grpo.cli.main_job --config my.yaml --trainer.max_steps 20

Arguments are `lightning-grpo fit` arguments (the default config is the packaged `arithmetic.yaml`). It prints the
held-out greedy accuracy before and after, the minutes the fit took and the peak memory, writes `reward.png`
(training reward per step, held-out accuracy at each validation; steps counted as the log counts them, so the
point of "Validation at step 16" is at 16) and `summary.json` beside the CSV logger's
`metrics.csv` and `completions.csv`, and ends with where they are. The printed output fits one screen besides the
progress bar: Lightning's start-up notes (devices found, a logger tip) and its model summary are left out, and the
policy is described in one line instead (`--trainer.enable_model_summary true` brings the summary back).
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import threading
import time
from importlib.resources import files
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

DEFAULT_CONFIG = str(files("lightning_grpo.configs") / "arithmetic.yaml")
ACCURACY = "val/rewards/accuracy"


def main(argv: list[str] | None = None, *, held_out: str = ACCURACY, allow_stall: bool = False) -> dict[str, Any]:
    """Run the main job with `lightning-grpo fit` arguments `argv` (default `sys.argv[1:]`); returns its summary.

    `held_out` is the validation metric printed before and after (a recipe's score, e.g. `val/rewards/solved`).
    With `allow_stall`, a stall (`RolloutStallError`: a full pass over the prompts trained nothing, as when the
    policy already solves every prompt) ends the fit like its end: the job validates, reports and returns, with the
    stall's message as the summary's `stall` (None otherwise); without it, the stall is raised.
    """
    from .app import cli

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--config" not in argv:
        argv = ["--config", DEFAULT_CONFIG, *argv]
    memory = _PeakMemory()
    _quiet_lightning_notes()
    # The command line of this process is the run's (Lightning re-runs it for DDP ranks); one screen without the
    # model summary, which a flag can bring back.
    program, sys.argv = sys.argv, [sys.argv[0], "--trainer.enable_model_summary", "false", *argv]
    try:
        summary = _run(cli(None, run=False), memory, held_out, allow_stall)
    finally:
        sys.argv = program
    return summary


def _run(command: Any, memory: _PeakMemory, held_out: str = ACCURACY, allow_stall: bool = False) -> dict[str, Any]:
    trainer, module, datamodule = command.trainer, command.model, command.datamodule
    validations = _LastValidation(held_out)
    trainer.callbacks.append(validations)
    label = _label(held_out)

    before = _accuracy(trainer.validate(module, datamodule=datamodule, verbose=False), held_out)
    print(f"held-out {label} before training: {before:.3f}", flush=True)
    print(_describe_policy(module), flush=True)
    started = time.monotonic()
    stall = _fit(trainer, module, datamodule, allow_stall)
    minutes = (time.monotonic() - started) / 60
    # The fit validates when the stream ends it; validate again only if that did not happen after the last step
    # (a stall before the first step left the policy as it was validated before).
    after = before if stall is not None and trainer.global_step == 0 else validations.accuracy_at(trainer.global_step)
    if after is None:
        after = _accuracy(trainer.validate(module, datamodule=datamodule, verbose=False), held_out)

    log_dir = _csv_log_dir(trainer)
    summary = {
        "accuracy_before": before,
        "accuracy_after": after,
        "fit_minutes": round(minutes, 2),
        "optimizer_steps": trainer.global_step,
        "groups_consumed": len(datamodule.progress.consumed),
        "peak_rss_gb": memory.stop(),
        "stall": stall,
        "metrics_csv": str(log_dir / "metrics.csv"),
        "completions_csv": str(log_dir / "completions.csv"),
        "plot": str(log_dir / "reward.png"),
    }
    if (log_dir / "metrics.csv").exists():
        plot_rewards(log_dir / "metrics.csv", log_dir / "reward.png", before=before, held_out=held_out)
    (log_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(
        f"held-out {label} after training:  {after:.3f}  ({summary['optimizer_steps']} optimizer steps, "
        f"{summary['groups_consumed']} prompt groups, fit {minutes:.1f} min, peak memory {summary['peak_rss_gb']} GB)"
    )
    for label, path in (
        ("metrics", summary["metrics_csv"]),
        ("completions table", summary["completions_csv"]),
        ("reward plot", summary["plot"]),
        ("summary", str(log_dir / "summary.json")),
        *(("TensorBoard", f"tensorboard --logdir {logger.log_dir}") for logger in _tensorboards(trainer)),
    ):
        print(f"{label + ':':<19}{path}", flush=True)
    return summary


def _fit(trainer: pl.Trainer, module: Any, datamodule: Any, allow_stall: bool) -> str | None:
    """`trainer.fit`; the stall's message when it stalled and `allow_stall`, else None (a stall is raised)."""
    from ..callbacks import RolloutStallError

    try:
        trainer.fit(module, datamodule=datamodule)
    except RolloutStallError as stall:
        if not allow_stall:
            raise
        print(f"GRPO stopped after {trainer.global_step} optimizer steps: {stall}", flush=True)
        return str(stall)
    return None


def _describe_policy(module: Any) -> str:
    parameters = list(module.policy.parameters())
    total = sum(p.numel() for p in parameters)
    trainable = sum(p.numel() for p in parameters if p.requires_grad)
    dtype = str(parameters[0].dtype).removeprefix("torch.") if parameters else "?"
    name = module.model_name or type(module.policy).__name__
    return f"policy {name}: {total / 1e6:.1f} M parameters ({trainable / 1e6:.1f} M trained), {dtype}"


def _csv_log_dir(trainer: pl.Trainer) -> Path:
    """The CSV logger's folder (the metrics and the completions table); else the first logger's, else `.`."""
    loggers = sorted(trainer.loggers, key=lambda logger: not isinstance(logger, CSVLogger))
    return Path(loggers[0].log_dir if loggers and loggers[0].log_dir else ".")


def _tensorboards(trainer: pl.Trainer) -> list[TensorBoardLogger]:
    return [logger for logger in trainer.loggers if isinstance(logger, TensorBoardLogger)]


class _LightningNotes(logging.Filter):
    """Drops Lightning's start-up notes: the accelerators it found, a tip for its cloud logger, the seed."""

    NOTES = ("GPU available", "TPU available", "HPU available", "💡 Tip", "Seed set to")

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(note in message for note in self.NOTES)


def _quiet_lightning_notes() -> None:
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.seed"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _LightningNotes) for f in logger.filters):
            logger.addFilter(_LightningNotes())


def optimizer_steps(metrics: Any) -> Any:
    """The optimizer steps done when each row of a `metrics.csv` (a pandas DataFrame) was logged, as a Series.

    This is the numbering of the progress bar ("Validation at step 16"), `trainer.global_step`, checkpoint names
    and `summary.json`: the first step's training row is 1, and so is a validation right after it; a validation
    before training (the main job's "before") is 0. The CSV's own `step` column is Lightning's 0-based index of the
    step that logged the row, which puts a validation after 16 steps at 15. Rows are in the order they were logged.
    """
    training = [
        column for column in metrics.columns if column not in ("step", "epoch") and not column.startswith("val/")
    ]
    trained = metrics[training].notna().any(axis=1).to_numpy().cumsum() > 0  # from the first training row on
    return (metrics["step"] + 1).where(trained, 0).astype(int)


def plot_rewards(
    metrics_csv: Path, out: Path | None = None, before: float | None = None, held_out: str = ACCURACY
) -> Any:
    """Training reward per optimizer step (and its running mean), and held-out `held_out` at each validation.

    Steps are counted as `optimizer_steps` does (1 = after the first step); `before`, the held-out score before
    training, is drawn at 0 unless the CSV already has a validation there. Writes the figure to `out` (if given) and
    returns it (a `matplotlib.figure.Figure`).
    """
    import pandas as pd
    from matplotlib.figure import Figure

    metrics = pd.read_csv(metrics_csv)
    metrics["optimizer_step"] = optimizer_steps(metrics)
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    if "reward" in metrics:
        train = metrics[["optimizer_step", "reward"]].dropna()
        ax.plot(train["optimizer_step"], train["reward"], alpha=0.35, label="training reward (per step)")
        mean = train["reward"].rolling(8, min_periods=1).mean()
        ax.plot(train["optimizer_step"], mean, label="training reward (mean of 8)")
    val = metrics[["optimizer_step", held_out]].dropna() if held_out in metrics else metrics.iloc[:0]
    steps, values = list(val["optimizer_step"]), list(val.get(held_out, []))
    if before is not None and 0 not in steps:
        steps, values = [0, *steps], [before, *values]
    if steps:
        ax.plot(steps, values, "o-", label=f"held-out greedy {_label(held_out)}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    fig.tight_layout()
    if out is not None:
        fig.savefig(out, dpi=120)
    return fig


def _accuracy(results: list[dict[str, float]], held_out: str = ACCURACY) -> float:
    values = [r[held_out] for r in results if held_out in r]
    return float(values[0]) if values else float("nan")


def _label(held_out: str) -> str:
    return held_out.removeprefix("val/rewards/").removeprefix("val/")


class _LastValidation(pl.Callback):
    """Remembers the held-out score (`held_out`) of the latest validation and the optimizer step it ran at."""

    def __init__(self, held_out: str = ACCURACY) -> None:
        self.held_out = held_out
        self.step: int | None = None
        self.accuracy: float | None = None

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking and self.held_out in trainer.callback_metrics:
            self.step, self.accuracy = trainer.global_step, float(trainer.callback_metrics[self.held_out])

    def accuracy_at(self, step: int) -> float | None:
        return self.accuracy if self.step == step else None


class _PeakMemory:
    """Samples the resident memory of a process (default this one) and all its descendants (rollout child, reward
    workers); `benchmarks/lora.py` samples a child process's tree with it."""

    def __init__(self, interval_s: float = 0.5, pid: int | None = None) -> None:
        self.peak = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, args=(interval_s, pid), name="peak-memory", daemon=True)
        self._thread.start()

    def _sample(self, interval_s: float, pid: int | None) -> None:
        import psutil

        with contextlib.suppress(psutil.Error):  # the process ended
            root = psutil.Process(pid)
            while not self._done.wait(interval_s):
                total = 0
                for process in [root, *root.children(recursive=True)]:
                    with contextlib.suppress(psutil.Error):
                        total += process.memory_info().rss
                self.peak = max(self.peak, total)

    def stop(self) -> float:
        """Stop sampling; the peak in GiB."""
        self._done.set()
        self._thread.join()
        return round(self.peak / 1024**3, 2)


if __name__ == "__main__":
    main()
