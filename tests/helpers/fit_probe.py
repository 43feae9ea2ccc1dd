"""The suite's one step recorder: a callback that records, on every rank of a fit, what the tests check across
processes and machines (the prompt groups of each trained step, the global step, a digest of the policy's full
weights, rank 0's ledger) and, in memory, what in-process tests check (each step's samples, advantages, metrics).

In a `lightning-grpo fit`, give it as `trainer.callbacks: [{class_path: helpers.fit_probe.StepRecorder, init_args:
{out: DIR}}]` with `tests/` on `PYTHONPATH` (`helpers.processes.start_session` puts it there). With `out`, each rank
rewrites `DIR/rank<global rank>.json` (atomically: a test polling it never reads half a file) after every step, when
the fit ends and when it fails.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl


class StepRecorder(pl.Callback):
    """Records each trained step on every rank; optionally kills rank 0, or holds every rank, at a step.

    Args:
        out: folder of the per-rank JSON records; None keeps the records in memory only.
        kill_at: global rank 0 SIGKILLs its own process at the start of the step after `kill_at` (as a node that
            dies), once a checkpoint of step `kill_at` can exist.
        hold_step: at this global step, every rank touches `<out>/in_step<rank>` at `on_train_batch_start` and
            sleeps `hold_s`, so a signal the test sends on seeing the files arrives during the step.
        hold_s: how long that step is held.

    Attributes:
        records: per trained step, in order (this rank's view): `groups` (its group ids), `samples`, `advantages`
            (`{uid: advantage}` of its micro-batches), `version` (weight pushes before it), `metrics` (the scalar
            callback metrics after it) and `global_step` (after it).
    """

    def __init__(
        self, out: str | None = None, kill_at: int | None = None, hold_step: int = -1, hold_s: float = 0.0
    ) -> None:
        self.out = Path(out) if out is not None else None
        self.kill_at = kill_at
        self.hold_step = hold_step
        self.hold_s = hold_s
        self.records: list[dict[str, Any]] = []
        self.had_rollout_child = False
        self._pending: dict[str, Any] = {}
        self._failed_at: float | None = None
        self._digest = ""

    @property
    def steps(self) -> list[list[int]]:
        """Each trained step's group ids, sorted."""
        return [record["groups"] for record in self.records]

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.kill_at is not None and trainer.is_global_zero and trainer.global_step == self.kill_at:
            self.dump(trainer)
            os.kill(os.getpid(), signal.SIGKILL)
        if trainer.global_step == self.hold_step and self.out is not None:
            (self.out / f"in_step{trainer.global_rank}").touch()
            time.sleep(self.hold_s)
        self._pending = {
            "groups": sorted(batch.group_ids),
            "samples": list(batch.samples),
            "advantages": _advantages(batch),
            "version": getattr(getattr(trainer.datamodule, "weight_sync", None), "version", None),
        }

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
        self.records.append({**self._pending, "metrics": metrics, "global_step": trainer.global_step})
        self.had_rollout_child = (
            self.had_rollout_child or getattr(trainer.datamodule, "rollout_worker", None) is not None
        )
        self._digest = weights_digest(trainer, pl_module)  # every rank: gathering sharded weights is a collective
        self.dump(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._digest = weights_digest(trainer, pl_module)
        self.dump(trainer, ended=True)

    def on_exception(self, trainer: pl.Trainer, pl_module: Any, exception: BaseException) -> None:
        self._failed_at = time.time()
        self.dump(trainer, error=f"{type(exception).__name__}: {exception}")

    def extra(self, trainer: pl.Trainer) -> dict[str, Any]:
        """More fields for the JSON record (a subclass's)."""
        return {}

    def dump(self, trainer: pl.Trainer, *, ended: bool = False, error: str | None = None) -> None:
        if self.out is None:
            return
        progress = getattr(trainer.datamodule, "progress", None) if trainer.is_global_zero else None
        summary = getattr(trainer.datamodule, "progress_summary", None)
        record = {
            "global_rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "node_rank": trainer.node_rank,
            "global_step": trainer.global_step,
            "steps": self.steps,
            "weights": self._digest,
            "ended": ended,
            "error": error,
            "failed_at": self._failed_at,  # wall time the fit failed at (`on_exception`), before its teardown
            "rollout_child": self.had_rollout_child,
            "consumed": sorted(progress.consumed) if progress is not None else [],  # rank 0's ledger
            "dropped": {**progress.dropped, **progress.excluded} if progress is not None else {},
            "summary": summary() if ended and progress is not None and summary is not None else None,
            **self.extra(trainer),
        }
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / f"rank{trainer.global_rank}.json"
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(record))
        os.replace(partial, path)


def weights_digest(trainer: pl.Trainer, pl_module: Any) -> str:
    """A digest of the policy's full weights (gathered when sharded: call it on every rank at once)."""
    from lightning_grpo.weights.parameters import full_parameters, generator_parameters

    digest = hashlib.sha256()
    with full_parameters(trainer.model):
        for name, tensor in sorted(generator_parameters(pl_module.policy), key=lambda item: item[0]):
            digest.update(name.encode())
            digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _advantages(batch: Any) -> dict[int, float]:
    advantages = {}
    for mb in batch.micro_batches:
        if "sample_advantage" not in mb:
            continue
        for uid, advantage in zip(mb["sample_uid"].tolist(), mb["sample_advantage"].tolist(), strict=True):
            if uid >= 0:
                advantages[uid] = advantage
    return advantages
