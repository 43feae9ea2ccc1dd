"""The deterministic schedule of prompt groups: which prompt each group id draws, epoch by epoch."""

from __future__ import annotations

from collections.abc import Container, Iterator
from functools import lru_cache

import numpy as np


class GroupSchedule:
    """Maps group ids to prompts: group `g` is prompt `perm(seed, epoch)[g % N]` of epoch `g // N`.

    There are `epochs * num_prompts` groups in all. Each epoch visits every prompt once in its own shuffled order,
    and the same `(num_prompts, epochs, seed)` always gives the same schedule, which is what lets a resumed run skip
    exactly the groups it already consumed and regenerate only the others.

    Args:
        num_prompts: N, the number of prompts in the dataset.
        epochs: passes over the prompts.
        seed: seeds each epoch's permutation.
        shuffle: False keeps dataset order in every epoch.
    """

    def __init__(self, num_prompts: int, epochs: int = 1, seed: int = 0, shuffle: bool = True) -> None:
        if num_prompts < 1:
            raise ValueError(f"`GroupSchedule(num_prompts={num_prompts})` needs at least one prompt.")
        if epochs < 1:
            raise ValueError(f"`GroupSchedule(epochs={epochs})` must be at least 1.")
        self.num_prompts = num_prompts
        self.epochs = epochs
        self.seed = seed
        self.shuffle = shuffle

    def __len__(self) -> int:
        return self.num_prompts * self.epochs

    @lru_cache(maxsize=4)  # noqa: B019 - a schedule lives as long as its run; epochs are few
    def _permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_prompts)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_prompts)

    def prompt_index(self, group_id: int) -> int:
        """Index into the dataset of the prompt group `group_id` draws."""
        if not 0 <= group_id < len(self):
            raise IndexError(f"group id {group_id} is outside the schedule's {len(self)} groups.")
        epoch, position = divmod(group_id, self.num_prompts)
        return int(self._permutation(epoch)[position])

    def group_ids(self, skip: Container[int] = ()) -> Iterator[int]:
        """Every group id in order, leaving out those in `skip` (the consumed ids of a resumed run)."""
        return (g for g in range(len(self)) if g not in skip)
