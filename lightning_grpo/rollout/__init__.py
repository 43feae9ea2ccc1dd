"""Everything the CUDA-free rollout process imports: the loop, the worker handle, the embedded generator, the reward
pool, the group schedule, advantages and the records that cross the process boundary.

Nothing here imports Lightning or the trainer side (`tests/test_public_api.py` checks it), so the spawned child
starts in a fraction of a second. Names load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._imports import lazy_exports

_EXPORTS = {
    "GRPORolloutLoop": "loop",
    "GRPORolloutWorker": "worker",
    "RewardProcessPool": "reward_pool",
    "compute_group_advantages": "advantages",
    "RolloutSample": "records",
    "SCORE_PAYLOAD": "records",
    "GroupSchedule": "schedule",
    "EmbeddedGenerator": "generator",
    "GeneratorSpec": "generator",
    "PolicySpec": "generator",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from .advantages import compute_group_advantages
    from .generator import EmbeddedGenerator, GeneratorSpec, PolicySpec
    from .loop import GRPORolloutLoop
    from .records import SCORE_PAYLOAD, RolloutSample
    from .reward_pool import RewardProcessPool
    from .schedule import GroupSchedule
    from .worker import GRPORolloutWorker
