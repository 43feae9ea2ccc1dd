"""The stream adapter: a planner's steps, ended by the one `RolloutStop` that tells every rank how the run ended."""

from __future__ import annotations

import logging
import traceback
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from .ledger import RolloutStop

log = logging.getLogger(__name__)


class StopAwareDataset(torch.utils.data.IterableDataset):
    """A rollout batcher whose stream ends with the `RolloutStop` it raised.

    Iterates `batcher` (the `StepPlanner`) and yields its step plans; when it raises `RolloutStop`, yields that stop as
    the last item and ends at once (reading on would wait for rollouts that never come). Any other exception (the
    rollout child died, a scorer failed) is logged and becomes `RolloutStop(error=<type, message and traceback>)`, so
    every rank learns it instead of hanging in a collective; a batcher that simply runs out ends with `RolloutStop()`.
    Iterating again after the stop yields the same stop item once more.

    Use it with `DataLoader(dataset, batch_size=None, num_workers=0, collate_fn=ProgressCollator(...))` on rank 0.
    """

    def __init__(self, batcher: Iterable[Any]) -> None:
        super().__init__()
        self.batcher = batcher
        self.stop: RolloutStop | None = None

    def __iter__(self) -> Iterator[Any]:
        if self.stop is None:
            try:
                yield from self.batcher
                self.stop = RolloutStop()
            except RolloutStop as stop:
                self.stop = stop
            except Exception as exc:
                log.error("Rank 0's rollout pipeline failed; stopping every rank.", exc_info=exc)
                self.stop = RolloutStop(error=describe_failure(exc))
        yield self.stop


def describe_failure(exc: BaseException) -> str:
    trace = "".join(traceback.format_exception(exc))
    return f"Rank 0's rollout pipeline failed with {type(exc).__name__}: {exc}\n\nTraceback on rank 0:\n{trace}"
