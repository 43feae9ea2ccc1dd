"""A long fit on the tiny model with faults injected, watching whether anything grows.

One `Trainer.fit` of `GRPOModule`/`GRPODataModule` on `--prompts` prompts for about `--steps` optimizer steps, whose
second reward function raises on every `--raise-every`-th prompt and hangs past the reward timeout on every
`--hang-every`-th (so each epoch has the same faults: the pool scores them NaN, kills the hung worker and starts
another). A thread samples, every `--interval` seconds, the resident memory, open file descriptors and threads of
the trainer (this process) and of the rollout process, the processes of the run (this one and its descendants) and
the /dev/shm segments they map or hold open (and, for reference, all of /dev/shm: other users' count there too).

It prints each series at a few evenly spaced steps, and a verdict per series: the growth over the second half of
the run (the least-squares line through its samples, slope times span), flat when it grows by no more than a
tolerance (5% of the level for memory, one for counts; a decline, such as memory the kernel reclaims from a busy
machine, is flat). Then the fault counters the run logged against the faults it was given:
every raise must be one `reward_pool/errors_total`, every hang one `reward_pool/timeouts_total`. The figures and
the verdicts also go to `--out/soak.json`.

    python benchmarks/soak.py --steps 2000           # about an hour on 2 shared cores
    python benchmarks/soak.py --steps 40 --out /tmp  # a smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

import common  # noqa: F401 - the offline environment, before torch loads
import numpy as np
import psutil

GROUPS_PER_STEP = 2  # samples_per_row=8 rows of num_generations=4: two groups in each one-row step
SERIES = ("trainer_rss_mb", "trainer_fds", "trainer_threads", "rollout_rss_mb", "rollout_fds", "rollout_threads")
SERIES += ("processes", "shm_segments")
COUNTERS = ("reward_pool/calls_total", "reward_pool/errors_total", "reward_pool/timeouts_total")
COUNTERS += ("reward_pool/restarts_total",)


def char_sum(completions: list, **kwargs: Any) -> list[float]:
    """Varies with every character, so the random policy's groups carry a signal and train."""
    return [sum(map(ord, c[0]["content"])) % 97 / 97 for c in completions]


def flaky(completions: list, fault: list[str], **kwargs: Any) -> list[float]:
    """1.0, except on cue from the prompt's `fault` column: raise, or hang far past any reward timeout."""
    if fault[0] == "raise":
        raise RuntimeError("flaky raised on cue")
    if fault[0] == "hang":
        time.sleep(3600)
    return [1.0 for _ in completions]


def prompts(n: int, raise_every: int, hang_every: int) -> Any:
    """`n` prompts with their `fault` column (hang wins where both fall on one prompt)."""
    from datasets import Dataset

    faults = ["hang" if i % hang_every == 1 else "raise" if i % raise_every == 0 else "" for i in range(n)]
    return Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": f"Say {i}."}] for i in range(n)], "fault": faults}
    )


def shm_segments(processes: list[psutil.Process]) -> int:
    """/dev/shm files the processes map or hold open (each counted once)."""
    paths: set[str] = set()
    for process in processes:
        try:
            with open(f"/proc/{process.pid}/maps") as maps:
                paths.update(line.split(None, 5)[-1].strip() for line in maps if "/dev/shm/" in line)
            for fd in os.listdir(f"/proc/{process.pid}/fd"):
                target = os.readlink(f"/proc/{process.pid}/fd/{fd}")
                if target.startswith("/dev/shm/"):
                    paths.add(target)
        except OSError:  # the process ended between the listing and the read
            continue
    return len(paths)


def process_figures(process: psutil.Process | None) -> tuple[float, float, float]:
    """(RSS in MB, open fds, threads) of one process; NaN when it is not there."""
    try:
        return process.memory_info().rss / 2**20, float(process.num_fds()), float(process.num_threads())
    except (psutil.Error, AttributeError):
        return math.nan, math.nan, math.nan


class Sampler(threading.Thread):
    """Samples the run's figures every `interval` seconds until `stop` is set; `rows` holds them, with the step."""

    def __init__(self, trainer: Any, datamodule: Any, interval: float) -> None:
        super().__init__(daemon=True, name="soak-sampler")
        self.trainer, self.datamodule, self.interval = trainer, datamodule, interval
        self.me = psutil.Process()
        self.rows: list[dict[str, float]] = []
        self.stop = threading.Event()

    def sample(self) -> dict[str, float]:
        worker = self.datamodule.rollout_worker
        rollout = psutil.Process(worker.pid) if worker is not None and worker.pid else None
        family = [self.me, *self.me.children(recursive=True)]
        row = {"step": float(self.trainer.global_step), "time_s": time.monotonic()}
        row["trainer_rss_mb"], row["trainer_fds"], row["trainer_threads"] = process_figures(self.me)
        row["rollout_rss_mb"], row["rollout_fds"], row["rollout_threads"] = process_figures(rollout)
        row["processes"] = float(len(family))
        row["shm_segments"] = float(shm_segments(family))
        row["dev_shm_all"] = float(len(os.listdir("/dev/shm")))
        return row

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            try:
                self.rows.append(self.sample())
            except (psutil.Error, OSError, ValueError):  # a process ended mid-sample: the next one is whole
                continue


def fit(args: argparse.Namespace) -> tuple[list[dict[str, float]], dict[str, float], int]:
    """Run the fit with the sampler on; returns the samples, the last value of each counter and the steps run."""
    from lightning.pytorch.loggers.logger import Logger

    from lightning_grpo import GRPODataModule, GRPOModule

    class LastValues(Logger):
        """Keeps only the last value of each counter (a soak must not grow by its own bookkeeping)."""

        name, version = "soak", "0"

        def __init__(self) -> None:
            super().__init__()
            self.last: dict[str, float] = {}

        def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
            pass

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            self.last.update({k: float(v) for k, v in metrics.items() if k in COUNTERS})

    epochs = max(1, math.ceil(args.steps * GROUPS_PER_STEP / args.prompts))
    datamodule = GRPODataModule(
        model="tiny-random", dataset=prompts(args.prompts, args.raise_every, args.hang_every),
        reward_funcs=[char_sum, flaky], num_generations=4, max_completion_length=8, samples_per_row=8,
        epochs=epochs, reward_timeout=args.reward_timeout, reward_num_workers=args.reward_workers,
    )  # fmt: skip
    logger = LastValues()
    trainer = common.quiet_cpu_trainer(logger=logger, default_root_dir=args.out)
    sampler = Sampler(trainer, datamodule, args.interval)
    sampler.start()
    try:
        trainer.fit(GRPOModule("tiny-random", learning_rate=1e-3), datamodule=datamodule)
    finally:
        sampler.stop.set()
        sampler.join()
    return sampler.rows, logger.last, epochs


def verdict(rows: list[dict[str, float]], name: str) -> dict[str, Any]:
    """The least-squares growth of one series over the second half of the run (by step), and whether it is flat (no
    growth past the tolerance; a decline is flat)."""
    last_step = max(row["step"] for row in rows)
    late = [(row["step"], row[name]) for row in rows if row["step"] >= last_step / 2 and not math.isnan(row[name])]
    if len(late) < 3 or late[-1][0] == late[0][0]:
        return {"series": name, "samples": len(late), "flat": None}
    steps, values = np.array(late).T
    slope, _ = np.polyfit(steps, values, 1)
    growth = float(slope * (steps[-1] - steps[0]))
    level = float(np.mean(values))
    tolerance = 0.05 * level if name.endswith("_mb") else 1.0
    return {
        "series": name, "samples": len(late), "level": level, "growth": growth,
        "per_1000_steps": float(slope * 1000), "tolerance": tolerance, "flat": growth <= tolerance,
    }  # fmt: skip


def expected_faults(args: argparse.Namespace, epochs: int) -> dict[str, int]:
    faults = prompts(args.prompts, args.raise_every, args.hang_every)["fault"]
    return {
        "reward_pool/errors_total": faults.count("raise") * epochs,
        "reward_pool/timeouts_total": faults.count("hang") * epochs,
        "reward_pool/calls_total": 2 * args.prompts * epochs,  # both reward functions, once per group
    }


def report(args: argparse.Namespace, rows: list[dict[str, float]], counters: dict[str, float], epochs: int) -> dict:
    verdicts = [verdict(rows, name) for name in SERIES]
    expected = expected_faults(args, epochs)
    faults = {name: {"expected": count, "counted": counters.get(name)} for name, count in expected.items()}
    return {
        "machine": f"soak: commit {common.git_commit()}, {common.machine()}",
        "load_average": {"start": args.load_start, "end": os.getloadavg()},
        "options": {k: v for k, v in vars(args).items() if k != "load_start"} | {"out": str(args.out)},
        "steps": max((row["step"] for row in rows), default=0),
        "samples": rows,
        "verdicts": verdicts,
        "faults": faults,
        "restarts": counters.get("reward_pool/restarts_total"),
        "all_flat": all(v["flat"] for v in verdicts),
        "every_fault_counted": all(f["expected"] == f["counted"] for f in faults.values()),
    }


def print_report(result: dict) -> None:
    rows = result["samples"]
    print(result["machine"])
    start, end = result["load_average"]["start"], result["load_average"]["end"]
    print(f"load average: {start[0]:.2f} at the start, {end[0]:.2f} at the end; {result['steps']:.0f} steps\n")
    print("| step | " + " | ".join(SERIES) + " | dev_shm_all |")
    print("|" + "---|" * (len(SERIES) + 2))
    for row in [rows[i] for i in np.linspace(0, len(rows) - 1, min(12, len(rows))).astype(int)] if rows else []:
        print(f"| {row['step']:.0f} | " + " | ".join(f"{row[n]:.1f}" for n in (*SERIES, "dev_shm_all")) + " |")
    print("\n| series | level | growth over 2nd half | per 1000 steps | tolerance | flat |\n|---|---|---|---|---|---|")
    for v in result["verdicts"]:
        if v["flat"] is None:
            print(f"| {v['series']} | - | - | - | - | too few samples ({v['samples']}) |")
        else:
            print(f"| {v['series']} | {v['level']:.1f} | {v['growth']:+.2f} | {v['per_1000_steps']:+.2f} | "
                  f"{v['tolerance']:.2f} | {'yes' if v['flat'] else 'NO'} |")  # fmt: skip
    print("\n| fault counter | expected | counted |\n|---|---|---|")
    for name, f in result["faults"].items():
        print(f"| {name} | {f['expected']} | {f['counted']} |")
    print(f"\nworkers restarted: {result['restarts']}")
    print(f"verdict: {'flat' if result['all_flat'] else 'GROWS'}; "
          f"{'every fault counted' if result['every_fault_counted'] else 'FAULTS MISCOUNTED'}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps, about (whole epochs of prompts)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--raise-every", type=int, default=8, help="every n-th prompt's reward raises")
    parser.add_argument("--hang-every", type=int, default=16, help="every n-th prompt's reward hangs")
    parser.add_argument("--reward-timeout", type=float, default=1.0)
    parser.add_argument("--reward-workers", type=int, default=2)
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between samples")
    parser.add_argument("--out", type=Path, default=Path("soak_out"))
    args = parser.parse_args()
    for name in ("steps", "prompts", "raise_every", "hang_every", "reward_workers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be at least 1.")
    args.out.mkdir(parents=True, exist_ok=True)
    args.load_start = os.getloadavg()
    rows, counters, epochs = fit(args)
    result = report(args, rows, counters, epochs)
    (args.out / "soak.json").write_text(json.dumps(result, indent=1))
    print_report(result)


if __name__ == "__main__":
    main()
