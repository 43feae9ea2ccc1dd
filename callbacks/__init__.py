"""Lightning callbacks for async GRPO, installed as `lightning_grpo.callbacks`."""

from .completions_table import CompletionsTableCallback
from .preemption import PREEMPTED_EXIT_CODE, PreemptionCallback
from .progress_bar import GRPOProgressBar
from .rollout_metrics import RolloutMetricsCallback
from .rollout_stop import RolloutStallError, RolloutStopCallback, RolloutStreamError
from .weight_sync import WeightSyncCallback

__all__ = [
    "CompletionsTableCallback",
    "GRPOProgressBar",
    "PREEMPTED_EXIT_CODE",
    "PreemptionCallback",
    "RolloutMetricsCallback",
    "RolloutStallError",
    "RolloutStopCallback",
    "RolloutStreamError",
    "WeightSyncCallback",
]
