"""A real `Trainer.fit` of the tiny model, run as its own process by the tests (DDP ranks re-run this script).

Each rank writes `<out>/rank<r>.json`: the steps it trained (group ids per step), its global step and the error it
ended with, if any. Scenarios:

- `normal`: every group trains; the run ends by itself.
- `stall`: a constant reward; every group is dropped for no signal and the run must fail with the stall error.
- `kill_child`: rank 0 SIGKILLs the rollout child after the first step; every rank must fail with its error.
- `kill_self`: rank 0 SIGKILLs its own process at the start of step `--kill-at + 1` (checkpoints every step).
- `resume`: resume from `--ckpt`.
- `ctrl_c`: at the start of step `--kill-at + 1`, SIGINT to the whole process group, as Ctrl-C in a terminal sends it
  (the rollout child and its reward workers get it too).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import traceback
from datetime import timedelta
from pathlib import Path


def char_sum_reward(completions, **kwargs):
    return [sum(map(ord, c[0]["content"])) % 97 / 97 for c in completions]


def constant_reward(completions, **kwargs):
    return [1.0 for _ in completions]


def _dropped(trainer) -> dict:
    progress = getattr(trainer.datamodule, "progress", None)
    return {**progress.dropped, **progress.excluded} if progress is not None and trainer.is_global_zero else {}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--scenario", default="normal")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--kill-at", type=int, default=2)
    parser.add_argument("--ckpt", default=None)
    args = parser.parse_args()

    import lightning.pytorch as pl
    import torch
    from datasets import Dataset
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_grpo.datamodule import GRPODataModule
    from lightning_grpo.module import GRPOModule
    from lightning_grpo.pipeline.batch import StepBatch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    class Recorder(Callback):
        """Records each trained step's groups and the first samples' versions; kills on cue."""

        def __init__(self) -> None:
            self.steps: list[list[int]] = []
            self.first_versions: list[int] | None = None
            self.weights_at_fit_start: float | None = None

        def on_fit_start(self, trainer, pl_module):
            self.weights_at_fit_start = float(sum(p.double().sum() for p in pl_module.policy.parameters()))

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if args.scenario == "kill_self" and trainer.is_global_zero and trainer.global_step == args.kill_at:
                self.dump(trainer, None)
                os.kill(os.getpid(), signal.SIGKILL)
            if args.scenario == "ctrl_c" and trainer.is_global_zero and trainer.global_step == args.kill_at:
                self.dump(trainer, None)
                os.killpg(os.getpgid(0), signal.SIGINT)
            if self.first_versions is None and isinstance(batch, StepBatch) and batch.samples:
                self.first_versions = sorted({s.model_version for s in batch.samples})

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if isinstance(batch, StepBatch) and not batch.stop:
                self.steps.append(list(batch.group_ids))
                self.dump(trainer, None)
                weights = float(sum(p.double().sum() for p in pl_module.policy.parameters()))
                (out / f"weights_step{trainer.global_step}.json").write_text(json.dumps(weights))
            if args.scenario == "kill_child" and trainer.is_global_zero and len(self.steps) == 1:
                os.kill(trainer.datamodule.worker.pid, signal.SIGKILL)

        def dump(self, trainer, error):
            result = {
                "global_step": trainer.global_step,
                "steps": self.steps,
                "error": error,
                "first_versions": self.first_versions,
                "weights_at_fit_start": self.weights_at_fit_start,
                "dropped": _dropped(trainer),
            }
            (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))

    reward = constant_reward if args.scenario == "stall" else char_sum_reward
    prompts = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Say {i}."}] for i in range(args.prompts)]})
    datamodule = GRPODataModule(
        model="tiny-random",
        dataset=prompts,
        reward_funcs=[reward],
        num_generations=4,
        max_completion_length=8,
        gradient_accumulation_steps=1,
        samples_per_row=4,
        max_staleness=1,
        heartbeat_timeout=60,
    )
    module = GRPOModule("tiny-random", learning_rate=1e-3)
    recorder = Recorder()
    callbacks = [recorder]
    if args.scenario in ("kill_self", "resume"):
        callbacks.append(ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=1, save_top_k=-1))
    strategy = DDPStrategy(timeout=timedelta(seconds=60), process_group_backend="gloo") if args.devices > 1 else "auto"
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_epochs=-1,
        logger=CSVLogger(out, name="logs"),
        enable_checkpointing=args.scenario in ("kill_self", "resume"),
        enable_progress_bar=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        log_every_n_steps=1,
        callbacks=callbacks,
    )
    torch.manual_seed(0)
    error = None
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=args.ckpt)
    except Exception as exc:  # recorded per rank, then re-raised for the exit code
        error = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    recorder.dump(trainer, error)
    sys.exit(1 if error else 0)


if __name__ == "__main__":
    main()
