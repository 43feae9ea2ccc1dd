"""Reading a rollout worker's queue in tests."""

from __future__ import annotations

import queue
import time

from lightning_grpo.rollout.records import RolloutSample


def collect_groups(worker, count: int, timeout: float = 120.0) -> dict[int, list[RolloutSample]]:
    """Read samples until `count` whole groups arrived."""
    groups: dict[int, list[RolloutSample]] = {}
    deadline = time.monotonic() + timeout
    while sum(len(s) == s[0].group_rows for s in groups.values()) < count:
        assert time.monotonic() < deadline, f"only {len(groups)} groups after {timeout} s"
        worker.check_health(stale_after_s=60)
        try:
            sample = worker.rollout_buffer.get(timeout=0.5)
        except queue.Empty:
            continue
        groups.setdefault(sample.group_id, []).append(sample)
    return groups
