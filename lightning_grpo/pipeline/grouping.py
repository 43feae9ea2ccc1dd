"""The grouping stage: the rollout queue's samples, released a whole group at a time."""

from __future__ import annotations

import queue
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ..rollout.records import RolloutSample

Group = list[RolloutSample]


class GroupedQueue:
    """A view of the rollout queue that releases each group's samples together.

    A group is complete once `sample.group_rows` samples with its `group_id` arrived (forks can make that differ from
    `num_generations`). Complete groups come out in the order they completed; samples are passed on unchanged.

    Args:
        inner: the rollout queue of `RolloutSample`s (an `mp.Queue` or `queue.Queue`).
        health_check: called each time `poll_interval_s` passes with nothing on `inner`, e.g. the rollout worker's
            `check_health`, so that a dead rollout child raises here instead of leaving the trainer waiting forever.
        poll_interval_s: longest single wait on `inner`.

    Example::

        groups = GroupedQueue(worker.queue, health_check=worker.check_health)
        group = groups.get(timeout=5.0)  # list[RolloutSample], or raises queue.Empty
    """

    def __init__(
        self, inner: Any, *, health_check: Callable[[], None] | None = None, poll_interval_s: float = 1.0
    ) -> None:
        if poll_interval_s <= 0:
            raise ValueError(f"`GroupedQueue(poll_interval_s={poll_interval_s})` must be positive.")
        self.inner = inner
        self.health_check = health_check
        self.poll_interval_s = poll_interval_s
        self._partial: dict[int, Group] = {}
        self._ready: deque[Group] = deque()

    @property
    def partial_groups(self) -> int:
        """Groups with some, but not all, of their samples received."""
        return len(self._partial)

    def get(self, timeout: float | None = None) -> Group:
        """The next complete group; waits up to `timeout` seconds (forever if None), else raises `queue.Empty`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ready:
            wait = self.poll_interval_s
            if deadline is not None:
                wait = max(0.0, min(wait, deadline - time.monotonic()))
            try:
                sample = self.inner.get(timeout=wait)
            except queue.Empty:
                if self.health_check is not None:
                    self.health_check()
                if deadline is not None and time.monotonic() >= deadline:
                    raise
                continue
            self._add(sample)
        return self._ready.popleft()

    def _add(self, sample: RolloutSample) -> None:
        if sample.group_rows < 1:
            raise ValueError(
                f"A rollout sample of group {sample.group_id} says its group has group_rows={sample.group_rows} "
                "rows; every group has at least one. The rollout loop must set `RolloutSample.group_rows`."
            )
        group = self._partial.setdefault(sample.group_id, [])
        group.append(sample)
        if len(group) >= sample.group_rows:
            self._ready.append(self._partial.pop(sample.group_id))
