"""Step planning: our `StepPlanner` vs TRL 1.16's `TokenBudgetBatcher`, side by side on the same rollout streams.

Sections (all by default; pick with `--section NAME`):

- `planning`: planning time per sample and unique/raw token ratio (tree packing) on the streams of peers.md §5 A4:
  P128/C512/G8, P512/C256/G8, P1024/C128/G16 and a 512-token shared system prompt + P256/C256/G8; 32 groups,
  token budget 16384, one rank (one row per micro-batch for TRL, `steps=1` for ours, so the rows are the same size).
- `tail`: samples placed / samples produced on a finite stream (A6): TRL's batcher never yields its last partial
  micro-batch; ours emits the partial step, so it must reach 100%.
- `packed_step`: packed (tree attention) vs padded train-step time on the tiny model and SmolLM2-135M, from
  `benchmarks/packed_step.py` (which also compares the two tree-attention layouts).

Timings are medians of `--reps` runs after one warm-up run, in one process on the same inputs; never compare them
across machines, only the ratio. Add a section by writing `def section_<name>(args) -> None` and listing it in
`SECTIONS`.

Usage: `python benchmarks/planning.py [--section planning|tail|packed_step] [--reps 5] [--groups 32]`
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import common  # noqa: I001  (first: sets the offline environment before torch and TRL load)
import numpy as np  # noqa: E402
from trl.experimental.async_grpo.async_grpo_trainer import TokenBudgetBatcher  # noqa: E402

from lightning_grpo.pipeline.planner import StepPlanner
from lightning_grpo.rollout.records import RolloutSample

TOKEN_BUDGET = 16384
VOCAB = 32000


@dataclass(frozen=True)
class StreamSpec:
    name: str
    prompt: int  # prompt tokens per group
    completion: int  # completion tokens per sample
    group_size: int
    system: int = 0  # tokens of a system prompt shared by every group


STREAMS = [
    StreamSpec("P128/C512/G8", 128, 512, 8),
    StreamSpec("P512/C256/G8", 512, 256, 8),
    StreamSpec("P1024/C128/G16", 1024, 128, 16),
    StreamSpec("sys512+P256/C256/G8", 256, 256, 8, system=512),
]


def make_stream(spec: StreamSpec, num_groups: int, seed: int = 0) -> list[list[RolloutSample]]:
    """`num_groups` groups of random tokens: one prompt per group after the shared system prompt, distinct completions."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, VOCAB, spec.system)
    groups = []
    for group_id in range(num_groups):
        prompt = np.concatenate([system, rng.integers(0, VOCAB, spec.prompt)])
        group = []
        for i in range(spec.group_size):
            ids = np.concatenate([prompt, rng.integers(0, VOCAB, spec.completion)]).astype(np.int64)
            mask = np.r_[np.zeros(len(prompt), np.int64), np.ones(spec.completion, np.int64)]
            group.append(
                RolloutSample(
                    prompt="",
                    completion="",
                    input_ids=ids,
                    completion_mask=mask,
                    old_log_probs=np.zeros(len(ids), np.float32),
                    advantage=1.0 if i % 2 else -1.0,
                    model_version=0,
                    group_id=group_id,
                    group_rows=spec.group_size,
                )
            )
        groups.append(group)
    return groups


def trl_samples(groups: list[list[RolloutSample]]) -> list[dict]:
    """The same samples as TRL's `RolloutQueueDataset` yields them."""
    return [
        {
            "input_ids": s.input_ids,
            "completion_mask": s.completion_mask,
            "old_log_probs": s.old_log_probs,
            "advantage": s.advantage,
            "group_id": s.group_id,
            "metrics": s.metrics,
        }
        for group in groups
        for s in group
    ]


@dataclass
class Outcome:
    seconds: float
    placed: int  # samples in emitted rows
    unique: int  # unique (forwarded) tokens of emitted rows
    raw: int  # raw tokens of the samples placed


def run_trl(samples: list[dict], num_processes: int = 1) -> Outcome:
    start = time.perf_counter()
    micro_batches = list(TokenBudgetBatcher(samples, num_processes, TOKEN_BUDGET, defaultdict(list)))
    seconds = time.perf_counter() - start
    rows = [row for micro_batch in micro_batches for row in micro_batch]
    placed = [d for row in rows for d in row.samples]
    return Outcome(seconds, len(placed), sum(len(row.tokens) for row in rows), sum(len(d["input_ids"]) for d in placed))


def run_ours(groups: list[list[RolloutSample]], num_processes: int = 1, steps: int = 1) -> Outcome:
    start = time.perf_counter()
    planner = StepPlanner(
        groups, num_processes=num_processes, steps=steps, token_budget=TOKEN_BUDGET, samples_per_row=0
    )
    plans = list(planner)
    seconds = time.perf_counter() - start
    rows = [row for plan in plans for row in plan.rows]
    placed = [d for row in rows for d in row.samples if d["uid"] != -1]
    return Outcome(seconds, len(placed), sum(len(row.tokens) for row in rows), sum(len(d["input_ids"]) for d in placed))


def median_run(fn: Callable[[], Outcome], reps: int) -> Outcome:
    fn()  # warm-up
    outcomes = [fn() for _ in range(reps)]
    outcome = outcomes[0]
    outcome.seconds = statistics.median(o.seconds for o in outcomes)
    return outcome


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=True)]
    print(f"\n{title}")
    for i, line in enumerate([header, *rows]):
        cells = [
            cell.ljust(w) if j == 0 else cell.rjust(w) for j, (cell, w) in enumerate(zip(line, widths, strict=True))
        ]
        print("  ".join(cells))
        if i == 0:
            print("  ".join("-" * w for w in widths))


def section_planning(args: argparse.Namespace) -> None:
    rows = []
    for spec in STREAMS:
        groups = make_stream(spec, args.groups)
        samples = trl_samples(groups)
        trl = median_run(lambda: run_trl(samples), args.reps)  # noqa: B023 - called before the loop moves on
        ours = median_run(lambda: run_ours(groups), args.reps)  # noqa: B023
        produced = len(samples)
        trl_ms, ours_ms = 1e3 * trl.seconds / produced, 1e3 * ours.seconds / produced
        rows.append(
            [
                spec.name,
                f"{trl_ms:.3f}",
                f"{ours_ms:.3f}",
                f"{ours_ms / trl_ms:.2f}",
                f"{trl.unique / trl.raw:.3f}",
                f"{ours.unique / ours.raw:.3f}",
            ]
        )
    print_table(
        f"planning: {args.groups} groups, token_budget={TOKEN_BUDGET}, 1 rank (median of {args.reps})",
        ["stream", "TRL ms/sample", "ours ms/sample", "ours/TRL", "TRL unique/raw", "ours unique/raw"],
        rows,
    )
    print("unique/raw: forwarded tokens over raw sample tokens, over the rows each emitted (lower = more shared).")


def section_tail(args: argparse.Namespace) -> None:
    rows = []
    for spec in STREAMS:
        groups = make_stream(spec, args.groups)
        samples = trl_samples(groups)
        for num_processes in (1, 2):
            trl = run_trl(samples, num_processes)
            ours = run_ours(groups, num_processes)
            produced = len(samples)
            rows.append(
                [
                    spec.name,
                    str(num_processes),
                    f"{trl.placed}/{produced} ({trl.placed / produced:.1%})",
                    f"{ours.placed}/{produced} ({ours.placed / produced:.1%})",
                ]
            )
    print_table(
        f"tail: samples placed / produced on a finite stream of {args.groups} groups",
        ["stream", "ranks", "TRL placed", "ours placed"],
        rows,
    )


def section_packed_step(args: argparse.Namespace) -> None:
    """Packed (tree) vs padded train-step time on the tiny model and SmolLM2-135M (`benchmarks/packed_step.py`)."""
    import sys
    from pathlib import Path

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import packed_step

    step_args = argparse.Namespace(
        models=["tiny", "smollm2"], groups=[1, 2], reps=args.reps, warmup=2, threads=torch.get_num_threads()
    )
    packed_step.section_step(step_args)


SECTIONS: dict[str, Callable[[argparse.Namespace], None]] = {
    "planning": section_planning,
    "tail": section_tail,
    "packed_step": section_packed_step,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--section", choices=sorted(SECTIONS), action="append", help="default: all")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--groups", type=int, default=32)
    args = parser.parse_args()
    commit = common.git_commit()
    print(f"commit {commit or '?'} | {platform.processor() or platform.machine()} | {os.cpu_count()} CPUs")
    for name in args.section or list(SECTIONS):
        SECTIONS[name](args)


if __name__ == "__main__":
    main()
