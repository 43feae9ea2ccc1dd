"""A callback that records, on every rank of a `lightning-grpo fit`, what the tests check across processes and
machines: the prompt groups of each trained step, the global step, and a digest of the policy's full weights.

Give it to the command as `trainer.callbacks: [{class_path: helpers.fit_probe.StepRecorder, init_args: {out: DIR}}]`
with `tests/` on `PYTHONPATH`. Each rank writes `DIR/rank<global rank>.json` after every step and at the end.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
from pathlib import Path

import lightning.pytorch as pl


class StepRecorder(pl.Callback):
    """Records each trained step's group ids per rank; with `kill_at`, global rank 0 SIGKILLs its own process at the
    start of the step after `kill_at` (as a node that dies), once a checkpoint of step `kill_at` exists."""

    def __init__(self, out: str, kill_at: int | None = None) -> None:
        self.out = Path(out)
        self.kill_at = kill_at
        self.steps: list[list[int]] = []
        self.had_rollout_child = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.kill_at is not None and trainer.is_global_zero and trainer.global_step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append(sorted(batch.group_ids))
        self.had_rollout_child = self.had_rollout_child or trainer.datamodule.rollout_worker is not None
        self._dump(trainer, pl_module)

    def on_train_end(self, trainer, pl_module):
        self._dump(trainer, pl_module, ended=True)

    def _dump(self, trainer, pl_module, ended: bool = False) -> None:
        digest = hashlib.sha256()
        for name, param in sorted(pl_module.policy.state_dict().items()):
            digest.update(name.encode())
            digest.update(param.detach().cpu().contiguous().numpy().tobytes())
        record = {
            "global_rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "node_rank": trainer.node_rank,
            "global_step": trainer.global_step,
            "steps": self.steps,
            "weights": digest.hexdigest(),
            "ended": ended,
            "rollout_child": self.had_rollout_child,
        }
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))
