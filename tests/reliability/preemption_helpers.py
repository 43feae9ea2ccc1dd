"""What the preemption tests put into a real `lightning-grpo fit`: a log of the groups each step trained, a step
that can be made slow, and a slow reward (imported by the trainer and the reward workers through PYTHONPATH)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from lightning_grpo.rewards import numeric_closeness


class GroupLog(Callback):
    """Appends `{"step", "groups"}` per trained step (after its optimizer step, fsynced) and, at the end of a fit
    that ended normally, the data module's progress summary.

    Args:
        path: the JSON-lines file.
        slow_step: at this `global_step`, `on_train_batch_start` touches `<path>.in_step` and sleeps `slow_s`, so a
            signal the test sends on seeing that file arrives during the step.
        slow_s: how long that step is held.
    """

    def __init__(self, path: str, slow_step: int = -1, slow_s: float = 0.0) -> None:
        self.path = Path(path)
        self.slow_step = slow_step
        self.slow_s = slow_s

    def _write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.slow_step:
            Path(f"{self.path}.in_step").touch()
            time.sleep(self.slow_s)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._write({"step": trainer.global_step, "groups": list(batch.group_ids)})

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._write({"summary": trainer.datamodule.progress_summary()})


def slow_closeness(completions: list, **kwargs: Any) -> list[float | None]:
    """`numeric_closeness`, after `GRPO_TEST_REWARD_SLEEP` seconds: the trainer spends its time waiting for rollouts."""
    time.sleep(float(os.environ.get("GRPO_TEST_REWARD_SLEEP", "0")))
    return numeric_closeness(completions, **kwargs)
