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
the verdicts also go to `--out/soak.json`. It exits 1 when the trainer's or the rollout process's median resident
memory over the run's last quarter exceeds its median over the second quarter by more than 16 MB + 2%.

The first reward is noise, so every group carries a signal and the run trains about `--steps` steps however the
policy drifts (groups without signal would be dropped, and a collapsed tiny policy makes mostly those).

    python benchmarks/soak.py --steps 2000           # about 10 minutes on 2 cores
    python benchmarks/soak.py --steps 40 --out /tmp  # a smoke run
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import random
import sys
import threading
import time
import tracemalloc
from array import array
from pathlib import Path
from typing import Any

import common  # noqa: F401 - the offline environment, before torch loads
import numpy as np
import psutil

GROUPS_PER_STEP = 2  # samples_per_row=8 rows of num_generations=4: two groups in each one-row step
SERIES = ("trainer_rss_mb", "trainer_fds", "trainer_threads", "rollout_rss_mb", "rollout_fds", "rollout_threads")
SERIES += ("processes", "shm_segments")
#: Sampled and printed, not judged: all of /dev/shm (other users' count too) and the trainer's glibc heap.
SHOWN = ("dev_shm_all", "trainer_heap_in_use_mb", "trainer_heap_free_mb")
COUNTERS = ("reward_pool/calls_total", "reward_pool/errors_total", "reward_pool/timeouts_total")
COUNTERS += ("reward_pool/restarts_total",)
DROPPED = "progress/dropped_"  # the groups dropped, by reason (a collapsed policy's groups have no signal)
LEARNING_RATE = 2e-4
STALL_GROUPS = 1_000_000
#: The processes whose resident memory fails the soak when it grows (by `rss_quarters`).
JUDGED_RSS = ("trainer_rss_mb", "rollout_rss_mb")
#: How far a process's median RSS over the run's last quarter may exceed its median over the second quarter.
RSS_GROWTH_MB, RSS_GROWTH_FRAC = 16.0, 0.02


def noise(completions: list, **kwargs: Any) -> list[float]:
    """A uniform draw per completion: every group carries a signal, even one whose completions are all the same
    (what a tiny policy trained for hours collapses to), so no group is dropped and the run lasts the steps asked;
    and the policy's expected update is zero, so it drifts rather than collapses."""
    return [random.random() for _ in completions]


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


class MallInfo2(ctypes.Structure):
    """glibc's `struct mallinfo2`: the heap of every malloc arena, in bytes."""

    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks")]
    _fields_ += [(name, ctypes.c_size_t) for name in ("fsmblks", "uordblks", "fordblks", "keepcost")]


def _libc() -> Any:
    """glibc with `mallinfo2` typed, or None elsewhere."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
    except (OSError, AttributeError):
        return None
    return libc


LIBC = _libc()


def malloc_heap() -> tuple[float, float]:
    """This process's glibc heap over all arenas, in MB: (in use, free but kept by the arenas); NaN off glibc.

    RSS that grows with the free part is fragmentation (`malloc_trim` hands it back); with the part in use, memory
    something still holds (in C or C++ when Python's traced memory stays flat)."""
    if LIBC is None:
        return math.nan, math.nan
    info = LIBC.mallinfo2()
    return (info.uordblks + info.hblkhd) / 2**20, info.fordblks / 2**20  # small blocks and mmapped ones; free


class Sampler(threading.Thread):
    """Samples the run's figures every `interval` seconds until `stop` is set; `rows` holds them, with the step.

    Samples are kept as columns of doubles (8 bytes a figure), so the soak's own bookkeeping barely grows.
    """

    def __init__(self, trainer: Any, datamodule: Any, interval: float) -> None:
        super().__init__(daemon=True, name="soak-sampler")
        self.trainer, self.datamodule, self.interval = trainer, datamodule, interval
        self.me = psutil.Process()
        self.columns: dict[str, array] = {}
        self.stop = threading.Event()

    @property
    def rows(self) -> list[dict[str, float]]:
        names = list(self.columns)
        return [dict(zip(names, values, strict=True)) for values in zip(*self.columns.values(), strict=True)]

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
        row["trainer_heap_in_use_mb"], row["trainer_heap_free_mb"] = malloc_heap()
        return row

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            try:
                row = self.sample()
            except (psutil.Error, OSError, ValueError):  # a process ended mid-sample: the next one is whole
                continue
            for name, value in row.items():
                self.columns.setdefault(name, array("d")).append(value)


def heap_figures() -> dict[str, float]:
    """RSS, glibc's heap in use and free, and the RSS once `malloc_trim(0)` gave the free pages back, in MB."""
    figures = {"rss_mb": psutil.Process().memory_info().rss / 2**20}
    if LIBC is not None:
        figures["malloc_in_use_mb"], figures["malloc_free_mb"] = malloc_heap()
        LIBC.malloc_trim(0)
        figures["rss_trimmed_mb"] = psutil.Process().memory_info().rss / 2**20
    return figures


def allocation_watch(first_step: int, frames: int) -> Any:
    """A callback that traces Python allocations (`tracemalloc`, `frames` deep) from the fit's start and snapshots
    them, with the heap's figures, at optimizer step `first_step` and at the fit's end; `.report(top)` compares
    the two. Each mark trims glibc's heap (`malloc_trim`), so what grew past a trim is held, not merely cached."""
    from lightning.pytorch.callbacks import Callback

    class AllocationWatch(Callback):
        def __init__(self) -> None:
            self.marks: list[dict[str, Any]] = []

        def mark(self, step: float) -> None:
            # Both marks measure with exactly the first snapshot held, so the snapshots' own memory cancels out.
            first = self.snapshot() if not self.marks else None
            figures = {"traced_mb": tracemalloc.get_traced_memory()[0] / 2**20, **heap_figures()}
            self.marks.append({"step": step, "snapshot": first or self.snapshot(), **figures})

        def snapshot(self) -> tracemalloc.Snapshot:
            ignored = [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, "<frozen importlib*")]
            return tracemalloc.take_snapshot().filter_traces(ignored)

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            tracemalloc.start(frames)

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == first_step and not self.marks:
                self.mark(trainer.global_step)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            if self.marks:
                self.mark(trainer.global_step)
            tracemalloc.stop()

        def report(self, top: int) -> dict[str, Any]:
            return allocation_growth(self.marks, top)

    return AllocationWatch()


def allocation_growth(marks: list[dict[str, Any]], top: int) -> dict[str, Any]:
    """What grew between the two marks: the `top` Python allocation sites (file:line) by bytes, the busiest call
    paths, and, per optimizer step, the traced (Python) growth beside glibc's heap and the RSS (what RSS grew past
    the heap in use is fragmentation or memory outside malloc)."""
    if len(marks) < 2:
        return {"error": "the run ended before the second quarter: nothing to compare"}
    first, last = marks[0], marks[-1]
    steps = max(last["step"] - first["step"], 1.0)

    def site(stat: Any, depth: int) -> dict[str, Any]:
        return {
            "where": [f"{frame.filename}:{frame.lineno}" for frame in reversed(stat.traceback[-depth:])],
            "kb": stat.size_diff / 1024, "count": stat.count_diff, "bytes_per_step": stat.size_diff / steps,
        }  # fmt: skip

    figures = [key for key in first if key.endswith("_mb") and key in last]
    return {
        "steps": [first["step"], last["step"]],
        **{key: [first[key], last[key]] for key in figures},
        "kb_per_step": {key: (last[key] - first[key]) * 1024 / steps for key in figures},
        "sites": [site(stat, 1) for stat in last["snapshot"].compare_to(first["snapshot"], "lineno")[:top]],
        "paths": [site(stat, 6) for stat in last["snapshot"].compare_to(first["snapshot"], "traceback")[: top // 3]],
    }


def fit(
    args: argparse.Namespace,
) -> tuple[list[dict[str, float]], dict[str, float], int, int, dict[str, Any] | None]:
    """Run the fit with the sampler on; returns the samples, the last value of each counter, the epochs run, the
    optimizer steps taken (the samples may miss the last ones) and the allocation report (None without
    `--tracemalloc`)."""
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
            kept = {k: float(v) for k, v in metrics.items() if k in COUNTERS or k.startswith(DROPPED)}
            self.last.update(kept)

    epochs = max(1, math.ceil(args.steps * GROUPS_PER_STEP / args.prompts))
    datamodule = GRPODataModule(
        model="tiny-random", dataset=prompts(args.prompts, args.raise_every, args.hang_every),
        reward_funcs=[noise, flaky], num_generations=4, max_completion_length=8, samples_per_row=8,
        epochs=epochs, reward_timeout=args.reward_timeout, reward_num_workers=args.reward_workers,
        # should groups still drop (stale ones), the run goes on: a soak watches resources, not learning
        stall_groups=STALL_GROUPS,
    )  # fmt: skip
    logger = LastValues()
    watch = allocation_watch(max(args.steps // 4, 1), args.tracemalloc_frames) if args.tracemalloc else None
    callbacks = [watch] if watch is not None else []
    trainer = common.quiet_cpu_trainer(logger=logger, default_root_dir=args.out, callbacks=callbacks)
    sampler = Sampler(trainer, datamodule, args.interval)
    sampler.start()
    try:
        trainer.fit(GRPOModule("tiny-random", learning_rate=LEARNING_RATE), datamodule=datamodule)
    finally:
        sampler.stop.set()
        sampler.join()
    allocations = watch.report(15) if watch is not None else None
    return sampler.rows, logger.last, epochs, trainer.global_step, allocations


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


def rss_quarters(rows: list[dict[str, float]], name: str) -> dict[str, Any]:
    """The median of `name` over the run's second quarter of steps and over its last, and whether the last stays
    within `RSS_GROWTH_MB` + `RSS_GROWTH_FRAC` of the second (`flat`; None with under 3 samples in a quarter).

    The first quarter is warm-up (allocator pools, caches filling); a run that keeps growing after it shows in the
    last quarter however noisy the samples are, as medians ignore a passing spike.
    """
    last_step = max((row["step"] for row in rows), default=0.0)
    quarters = [(last_step / 4, last_step / 2), (3 * last_step / 4, math.inf)]
    picked = [
        [(row["step"], row[name]) for row in rows if low <= row["step"] < high and not math.isnan(row[name])]
        for low, high in quarters
    ]
    if min(map(len, picked)) < 3:
        return {"series": name, "samples": [len(quarter) for quarter in picked], "flat": None}
    (second_step, second), (last_quarter_step, last) = (np.median(np.array(quarter), axis=0) for quarter in picked)
    growth, allowed = float(last - second), RSS_GROWTH_MB + RSS_GROWTH_FRAC * float(second)
    return {
        "series": name, "samples": [len(quarter) for quarter in picked], "second_quarter": float(second),
        "last_quarter": float(last), "growth": growth, "allowed": allowed,
        "kb_per_step": growth * 1024 / max(float(last_quarter_step - second_step), 1.0), "flat": growth <= allowed,
    }  # fmt: skip


def expected_faults(args: argparse.Namespace, epochs: int) -> dict[str, int]:
    faults = prompts(args.prompts, args.raise_every, args.hang_every)["fault"]
    return {
        "reward_pool/errors_total": faults.count("raise") * epochs,
        "reward_pool/timeouts_total": faults.count("hang") * epochs,
        "reward_pool/calls_total": 2 * args.prompts * epochs,  # both reward functions, once per group
    }


def report(
    args: argparse.Namespace, rows: list[dict[str, float]], counters: dict[str, float], epochs: int, steps: int
) -> dict:
    verdicts = [verdict(rows, name) for name in SERIES]
    expected = expected_faults(args, epochs)
    faults = {name: {"expected": count, "counted": counters.get(name)} for name, count in expected.items()}
    return {
        "machine": f"soak: commit {args.commit}, {common.machine()}",  # the code the run started with
        "load_average": {"start": args.load_start, "end": os.getloadavg()},
        "options": {k: v for k, v in vars(args).items() if k not in ("load_start", "commit")} | {"out": str(args.out)},
        "steps": steps,
        "samples": rows,
        "verdicts": verdicts,
        "rss_quarters": [rss_quarters(rows, name) for name in JUDGED_RSS],
        "faults": faults,
        "restarts": counters.get("reward_pool/restarts_total"),
        "dropped": {
            k.removeprefix(DROPPED).removesuffix("_total"): v for k, v in counters.items() if k.startswith(DROPPED)
        },
        "all_flat": all(v["flat"] for v in verdicts),
        "every_fault_counted": all(f["expected"] == f["counted"] for f in faults.values()),
    }


def rss_message(quarters: dict[str, Any]) -> str:
    """One line on `rss_quarters`' verdict."""
    label = f"{quarters['series'].removesuffix('_rss_mb')} RSS by quarter"
    if quarters["flat"] is None:
        return f"{label}: not judged, too few samples in the 2nd and last quarters {quarters['samples']}"
    figures = (
        f"median {quarters['second_quarter']:.1f} MB over the 2nd quarter, {quarters['last_quarter']:.1f} MB over "
        f"the last: {quarters['growth']:+.1f} MB ({quarters['kb_per_step']:+.1f} KB a step), allowed "
        f"{RSS_GROWTH_MB:.0f} MB + {RSS_GROWTH_FRAC:.0%} = {quarters['allowed']:.1f} MB"
    )
    return f"{label}: {'flat' if quarters['flat'] else 'GROWS'}, {figures}"


def rss_failure(verdicts: list[dict[str, Any]]) -> str | None:
    """The message the soak fails with when a process's RSS grew past the allowance (`rss_quarters`), else None."""
    grown = [rss_message(quarters) for quarters in verdicts if quarters["flat"] is False]
    if not grown:
        return None
    return f"soak.py failed: {'; '.join(grown)}. Rerun with --tracemalloc to see what grows in the trainer."


def print_report(result: dict) -> None:
    rows = result["samples"]
    print(result["machine"])
    start, end = result["load_average"]["start"], result["load_average"]["end"]
    print(f"load average: {start[0]:.2f} at the start, {end[0]:.2f} at the end; {result['steps']:.0f} steps\n")
    print("| step | " + " | ".join((*SERIES, *SHOWN)) + " |")
    print("|" + "---|" * (len(SERIES) + len(SHOWN) + 1))
    for row in [rows[i] for i in np.linspace(0, len(rows) - 1, min(12, len(rows))).astype(int)] if rows else []:
        print(f"| {row['step']:.0f} | " + " | ".join(f"{row[n]:.1f}" for n in (*SERIES, *SHOWN)) + " |")
    print("\n| series | level | growth over 2nd half | per 1000 steps | tolerance | flat |\n|---|---|---|---|---|---|")
    for v in result["verdicts"]:
        if v["flat"] is None:
            print(f"| {v['series']} | - | - | - | - | too few samples ({v['samples']}) |")
        else:
            print(f"| {v['series']} | {v['level']:.1f} | {v['growth']:+.2f} | {v['per_1000_steps']:+.2f} | "
                  f"{v['tolerance']:.2f} | {'yes' if v['flat'] else 'NO'} |")  # fmt: skip
    print("\n" + "\n".join(rss_message(quarters) for quarters in result["rss_quarters"]))
    print("\n| fault counter | expected | counted |\n|---|---|---|")
    for name, f in result["faults"].items():
        print(f"| {name} | {f['expected']} | {f['counted']} |")
    print(f"\nworkers restarted: {result['restarts']}; groups dropped: {result['dropped'] or 'none'}")
    print(f"verdict: {'flat' if result['all_flat'] else 'GROWS'}; "
          f"{'every fault counted' if result['every_fault_counted'] else 'FAULTS MISCOUNTED'}")  # fmt: skip


def print_allocations(growth: dict[str, Any]) -> None:
    if "error" in growth:
        print(f"\ntracemalloc: {growth['error']}")
        return
    first, last = growth["steps"]
    print(f"\n| trainer, step {first:.0f} -> {last:.0f} | MB | MB | KB a step |\n|---|---|---|---|")
    for key, per_step in growth["kb_per_step"].items():
        print(f"| {key.removesuffix('_mb')} | {growth[key][0]:.1f} | {growth[key][1]:.1f} | {per_step:+.2f} |")
    print("\n| allocation site | grew KB | blocks | bytes a step |\n|---|---|---|---|")
    for site in growth["sites"]:
        print(f"| {site['where'][0]} | {site['kb']:+.1f} | {site['count']:+d} | {site['bytes_per_step']:+.0f} |")
    print("\nbusiest call paths (innermost first):")
    for path in growth["paths"]:
        print(f"  {path['kb']:+.1f} KB, {path['count']:+d} blocks: " + " <- ".join(path["where"]))


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
    parser.add_argument(
        "--tracemalloc", action="store_true",
        help="trace the trainer's Python allocations and print the sites that grew from the 2nd quarter to the end",
    )  # fmt: skip
    parser.add_argument("--tracemalloc-frames", type=int, default=8, help="call-stack depth each allocation keeps")
    args = parser.parse_args()
    for name in ("steps", "prompts", "raise_every", "hang_every", "reward_workers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be at least 1.")
    args.out.mkdir(parents=True, exist_ok=True)
    args.load_start, args.commit = os.getloadavg(), common.git_commit()
    rows, counters, epochs, steps, allocations = fit(args)
    result = report(args, rows, counters, epochs, steps) | {"allocations": allocations}
    (args.out / "soak.json").write_text(json.dumps(result, indent=1))
    print_report(result)
    if allocations is not None:
        print_allocations(allocations)
    failure = rss_failure(result["rss_quarters"])
    if failure is not None:
        sys.exit(failure)


if __name__ == "__main__":
    main()
