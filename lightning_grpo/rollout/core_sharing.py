"""Lending idle cores between the trainer and the embedded generator when both share one CPU.

With `trainer_threads="auto"` on a CPU the trainer trains on the cores the generator leaves. Each side is idle at
times: the generator while pacing holds it back (it is `max_staleness` steps ahead) or it has nothing to sample, the
trainer while it waits for rollouts. `CoreSharing` lets each side run on the other's cores meanwhile: two flags in
shared memory, each set by one side as it goes idle or busy and read by the other at its next decode step (the
generator) or decoder layer (the trainer, forward and backward), where it sets its torch threads.

Torch threads are a per-thread setting (OpenMP's), so each side sets them in the thread that computes: the
generator's worker thread, the trainer's training thread.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.context import assert_spawning
from typing import Any

import torch


class CoreSharing:
    """The two idle flags, made in the trainer before the rollout child is spawned (they cross as process arguments).

    Args:
        trainer_threads: the trainer's own threads (the cores the generator leaves).
        generator_threads: the generator's own threads.
        ctx: the multiprocessing context the rollout child is spawned with.
    """

    def __init__(self, *, trainer_threads: int, generator_threads: int, ctx: Any = None) -> None:
        if trainer_threads < 1 or generator_threads < 1:
            raise ValueError(
                f"CoreSharing(trainer_threads={trainer_threads}, generator_threads={generator_threads}): both sides "
                "need at least one thread."
            )
        ctx = ctx or mp.get_context("spawn")
        self.trainer_threads = trainer_threads
        self.generator_threads = generator_threads
        # One byte each, written by one side only: no lock needed, a stale read costs one step at the wrong count.
        self._generator_idle = ctx.RawValue("b", 0)
        self._trainer_waiting = ctx.RawValue("b", 0)

    def __getstate__(self) -> dict[str, Any]:
        # Shared memory crosses to the rollout child only as a process argument, at spawn (the worker ships it so).
        assert_spawning(self)
        return self.__dict__

    # -- the generator's side (its worker thread in the rollout child) ----------------------------------------------

    def generator_busy(self) -> None:
        """Before a decode step: mark the generator busy; borrow the trainer's cores while it waits for rollouts."""
        self._generator_idle.value = 0
        borrowed = self.trainer_threads if self._trainer_waiting.value else 0
        _use_threads(self.generator_threads + borrowed)

    def generator_idle(self) -> None:
        """Before the generator waits for requests: its cores are the trainer's until the next decode step."""
        self._generator_idle.value = 1

    # -- the trainer's side ------------------------------------------------------------------------------------------

    @contextmanager
    def trainer_waiting(self) -> Iterator[None]:
        """Around the trainer's wait for rollouts: its cores are the generator's meanwhile."""
        self._trainer_waiting.value = 1
        try:
            yield
        finally:
            self._trainer_waiting.value = 0

    def trainer_compute(self) -> None:
        """Before a piece of the trainer's compute: borrow the generator's cores while it is idle."""
        borrowed = self.generator_threads if self._generator_idle.value else 0
        _use_threads(self.trainer_threads + borrowed)

    @property
    def generator_is_idle(self) -> bool:
        return bool(self._generator_idle.value)

    @property
    def trainer_is_waiting(self) -> bool:
        return bool(self._trainer_waiting.value)


def _use_threads(threads: int) -> None:
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
