"""Generator replicas: the same fit with the embedded generator in one process and in two, side by side in one run.

Real `Trainer.fit`s alternate between `generator_replicas=1` (the generator on a thread of the rollout child, with
core sharing) and `generator_replicas=2` (two replica processes, each pinned to a core of its own), both with
`generator_threads=1` and `trainer_threads="auto"` (`--configs` can add the single generator without core sharing),
over the same prompts, rewards and settings (one pass; arithmetic prompts, `--completions` per group, up to
`--max-tokens` each, `max_staleness=2`), for each `--models` entry. Reported per fit (median over `--repeats`): prompt groups consumed per second after the first optimizer step
(without the start-up, which a longer run amortises; replicas pay for their own import and model load there), the
trainer's idle fraction (its wait for rollouts over the same span), groups per CPU-second over the same span (the
CPU time of the trainer, the rollout child and the replicas: on a machine shared with other work, more busy processes
take a larger share of it, which groups per second alone would count as speed), and how the trained groups split
over the replicas (`extras["generator_replica"]`); then each configuration's ratios to 1 replica.

Read the figures with the machine in mind: on a 2-core machine the two one-core replicas and the trainer's one
thread oversubscribe the CPU (three busy threads on two cores, and the single generator's core sharing is gone), so
the run shows the bookkeeping (groups split over both replicas, every group consumed once) and what a second replica
costs where the CPU is the limit, not what it buys on a many-core box where each replica has cores of its own.

Usage: `python benchmarks/generator_replicas.py [--models tiny smollm2] [--prompts 24] [--repeats 1] [--configs ...]`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import common  # noqa: I001  (first: sets the offline environment before torch and TRL load)
import lightning.pytorch as pl  # noqa: E402
import psutil  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from scale_out import REWARDS, StepClock, fit_rates  # noqa: E402

from lightning_grpo import GRPODataModule, GRPOModule  # noqa: E402
from lightning_grpo.rollout import start_method  # noqa: E402
from lightning_grpo.rollout.records import GENERATOR_REPLICA  # noqa: E402

MODELS = common.MODELS
#: What each configuration changes; "1 replica, trainer_threads=1" is the single generator without core sharing, which
#: tells the gain of a process of its own from that of not lending cores.
CONFIGS = {
    "1 replica": {"generator_replicas": 1},
    "2 replicas": {"generator_replicas": 2},
    "1 replica, trainer_threads=1": {"generator_replicas": 1, "trainer_threads": 1},
}


class ReplicaSplit(pl.Callback):
    """How many trained groups each replica sampled, and the CPU seconds the fit's processes (the trainer, the rollout
    child and everything under it) had used at the end of the first optimizer step and of the last."""

    def __init__(self) -> None:
        self.groups: dict[int, int] = {}
        self.cpu: list[tuple[float, int]] = []  # (CPU seconds, groups consumed) after each step from step 1 on

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module, outputs, batch, batch_idx) -> None:
        for sample in batch.samples:
            self.groups[sample.group_id] = sample.extras.get(GENERATOR_REPLICA, 0)
        if trainer.global_step >= 1:
            self.cpu.append(
                (_cpu_seconds(trainer.datamodule.rollout_worker.pid), len(trainer.datamodule.progress.consumed))
            )

    def groups_per_cpu_s(self) -> float:
        (cpu_first, groups_first), (cpu_last, groups_last) = self.cpu[0], self.cpu[-1]
        return (groups_last - groups_first) / (cpu_last - cpu_first)


def _cpu_seconds(child_pid: int) -> float:
    """User + system CPU seconds of this process and of the rollout child's tree (the replicas included)."""
    child = psutil.Process(child_pid)
    total = 0.0
    for process in [psutil.Process(), child, *child.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            times = process.cpu_times()
            total += times.user + times.system
    return total


def run_fit(model: str, config: dict[str, Any], args: argparse.Namespace, out: Path) -> dict[str, float]:
    datamodule = GRPODataModule(
        model=MODELS[model],
        dataset="arithmetic",
        dataset_size=args.prompts,
        reward_funcs=REWARDS[model],
        num_generations=args.completions,
        max_completion_length=args.max_tokens,
        temperature=0.7,
        samples_per_row=args.completions,
        max_staleness=2,
        generator_threads=1,
        **config,
    )
    module = GRPOModule(MODELS[model], learning_rate=2e-5)
    clock, split = StepClock(), ReplicaSplit()
    trainer = common.quiet_cpu_trainer(callbacks=[clock, split], logger=CSVLogger(out))
    trainer.fit(module, datamodule=datamodule)
    rates = fit_rates(trainer, datamodule, clock, time.perf_counter())
    counts = Counter(split.groups.values())
    return rates | {
        "groups_per_cpu_s": split.groups_per_cpu_s(),
        "replica_0_groups": counts[0],
        "replica_1_groups": counts[1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["tiny", "smollm2"])
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--completions", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=["1 replica", "2 replicas"])
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    print(
        f"{common.machine()} ({cores} usable), commit {common.git_commit()}; {args.prompts} prompts x "
        f"{args.completions} completions of up to {args.max_tokens} tokens, one group per optimizer step; "
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        flush=True,
    )
    start_method.warm_up()
    order = []
    for repeat in range(args.repeats):
        order += args.configs if repeat % 2 == 0 else list(reversed(args.configs))
    print(
        "\n| model | replicas | groups/s after step 1 | groups per CPU-second | trainer idle fraction "
        "| groups replica 0 / 1 | consumed |"
    )
    print("|---|---|---|---|---|---|---|")
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            results: dict[str, list[dict[str, float]]] = {name: [] for name in args.configs}
            for i, name in enumerate(order):
                results[name].append(run_fit(model, CONFIGS[name], args, Path(tmp) / f"{model}-{i}"))
            median = {
                name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in results.items()
            }
            for name, m in median.items():
                print(
                    f"| {model} | {name} | {m['groups_per_s']:.3f} | {m['groups_per_cpu_s']:.4f} | {m['idle_frac']:.2f} | "
                    f"{m['replica_0_groups']:.0f} / {m['replica_1_groups']:.0f} | {m['consumed']:.0f} |",
                    flush=True,
                )
            base = median.get("1 replica")
            for name, m in median.items():
                if base is not None and name != "1 replica":
                    ratios.append(
                        f"{model}, {name}: {m['groups_per_s'] / base['groups_per_s']:.2f}x the groups per second of "
                        f"1 replica ({m['groups_per_cpu_s'] / base['groups_per_cpu_s']:.2f}x per CPU-second); "
                        f"trainer idle {m['idle_frac']:.2f} vs {base['idle_frac']:.2f}"
                    )
    for line in ratios:
        print(f"{line} ({cores} cores shared by the generators and the trainer)")
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
