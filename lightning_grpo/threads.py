"""Sharing the CPU between the trainer and the embedded generator.

On a CPU-only machine the rollout child generates while the trainer trains. With torch's default (one thread per
core) in the trainer plus the generator's threads, the two oversubscribe the cores and both slow down, so
`trainer_threads="auto"` gives the trainer the cores the generator leaves (`benchmarks/async_overlap.py` measures it).
"""

from __future__ import annotations

import os
from typing import Literal

TrainerThreads = int | Literal["auto"] | None


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity, which containers and `taskset` narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def is_trainer_threads(option: object) -> bool:
    """Whether `option` is a valid `trainer_threads`: a positive number of threads, `"auto"` or None."""
    return option is None or option == "auto" or (isinstance(option, int) and option >= 1)


def trainer_threads_for(
    option: TrainerThreads,
    *,
    current: int,
    on_cpu: bool,
    embedded_generator: bool,
    generator_threads: int | None,
    world_size: int,
) -> int | None:
    """The torch threads the trainer should train with, or None to leave torch's setting alone.

    `option` (valid, see `is_trainer_threads`): a number is used as given; None leaves torch alone; `"auto"` applies only where the trainer and the
    embedded generator share one machine's CPU (CPU accelerator, one process, `generator_threads` set) and gives the
    trainer the cores the generator does not use, never more threads than torch has now.
    """
    if option is None or option != "auto":
        return option
    if not (on_cpu and embedded_generator and generator_threads and world_size == 1):
        return None
    threads = max(1, available_cores() - generator_threads)
    return threads if threads < current else None
