"""How far the rollout loop may run ahead of the trainer: whole groups, within `max_staleness` steps."""

from __future__ import annotations


class Pacing:
    """Admission of prompt groups ahead of the trainer.

    A group is admitted while the groups admitted and not yet consumed by the trainer (trained and committed, or
    dropped) stay below the window, `(max_staleness + 1) * groups_per_step`: with a steady trainer no group arrives
    staler than `max_staleness`. Once the window is full, admission resumes only when a whole step's groups fit
    again, so a step's groups start together (prefilled and sampled in one batch, by the newest weights) instead of
    one at a time as the trainer drops single groups. Where the window is a single step (`max_staleness=0`) it
    resumes as soon as one group fits: the trainer's unfinished step may be waiting for a replacement of a group it
    dropped.

    A group the loop itself finds without learning signal (`dropped_early`, with `replace_early=True`) is
    consumed the moment it is scored, and its replacement starts then, full window or not: the trainer would
    otherwise find the drop only when it plans the step the group was meant for, and wait there for a replacement
    that had not started.

    Args:
        groups_per_step: prompt groups per optimizer step.
        max_staleness: policy versions a group may lag when it trains.
    """

    def __init__(self, groups_per_step: int, max_staleness: int) -> None:
        self.window = (max_staleness + 1) * groups_per_step
        self._resume_below = max(max_staleness * groups_per_step + 1, groups_per_step)
        self._held_back = False
        self._dropped_early = 0
        self._replaced_early = 0

    def dropped_early(self) -> None:
        """A scored group the trainer will drop (no learning signal): its place is free now, for a replacement."""
        self._dropped_early += 1

    def admits(self, ahead: int) -> bool:
        """Whether one more group may start now, with `ahead` groups admitted and not yet consumed by the trainer
        (the groups dropped early left out of its count; see `GRPORolloutLoop`)."""
        ahead -= self._dropped_early
        if self._replaced_early < self._dropped_early and ahead < self.window:
            self._replaced_early += 1
            return True
        self._held_back = ahead >= (self._resume_below if self._held_back else self.window)
        return not self._held_back
