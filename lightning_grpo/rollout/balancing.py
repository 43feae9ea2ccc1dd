"""Spreading one rollout loop's requests over several generation backends: one backend per group, new groups by load.

The vLLM servers of `vllm_server_url=[...]` (`vllm_routing.py`) and the embedded generator's replicas of
`generator_replicas=N` (`replicas.py`) are routed the same way, by a `GroupRouter`: a group's first request goes to
the live backend with the fewest requests in flight (on a tie, the one given the fewest groups), and every later
request of that group (its other completions, the later turns of its conversations) goes to the same backend, so a
group sees one backend's sequence of weights, as with a single backend. The loop says which group a request belongs
to through `current_group`, set in the asyncio task that runs one rollout.
"""

from __future__ import annotations

import contextvars
from collections import OrderedDict
from collections.abc import Sequence

#: The group whose rollout runs in the current asyncio task (`GRPORolloutLoop._rollout` sets it); None outside one.
current_group: contextvars.ContextVar[int | None] = contextvars.ContextVar("rollout_group", default=None)

# Groups whose backend is remembered; far more than can be in flight at once (max_inflight_tasks / num_generations).
_GROUP_MEMORY = 4096


class GroupRouter:
    """Which of `count` backends serves each request: the group's backend while it is live, else the least loaded.

    The caller counts its requests in flight in `inflight` (one entry per backend) and says which backends are live.

    Args:
        count: the number of backends.
    """

    def __init__(self, count: int) -> None:
        self.inflight = [0] * count
        self.groups_routed = [0] * count  # groups (and requests without a group) each backend was given
        self._groups: OrderedDict[int, int] = OrderedDict()

    def route(self, group_id: int | None, live: Sequence[int]) -> int:
        """The backend for the next request of `group_id` (None: a request of no group), one of `live` (not empty)."""
        target = self._groups.get(group_id) if group_id is not None else None
        if target is None or target not in live:
            target = min(live, key=lambda i: (self.inflight[i], self.groups_routed[i], i))
            self.groups_routed[target] += 1
            if group_id is not None:
                self._groups[group_id] = target
                self._groups.move_to_end(group_id)
                while len(self._groups) > _GROUP_MEMORY:
                    self._groups.popitem(last=False)
        return target

    def target_of(self, group_id: int) -> int | None:
        """The backend `group_id`'s requests went to, or None if it had none (or it was forgotten)."""
        return self._groups.get(group_id)
