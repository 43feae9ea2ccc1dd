"""The callbacks async GRPO needs, in the order they must run: what `GRPOModule.configure_callbacks` returns."""

from __future__ import annotations

import lightning.pytorch as pl

from .completions_table import CompletionsTableCallback
from .preemption import PreemptionCallback
from .rollout_metrics import RolloutMetricsCallback
from .rollout_stop import RolloutStopCallback
from .weight_sync import WeightSyncCallback

#: Callbacks that must run in this order after every optimizer step.
ORDERED = (WeightSyncCallback, RolloutStopCallback, RolloutMetricsCallback)


def required_callbacks(present: list[pl.Callback]) -> list[pl.Callback]:
    """The callbacks to add to a trainer that has `present`, so that `ORDERED` run in order.

    `WeightSyncCallback` pushes this step's weights; `RolloutStopCallback` then plans the next step (the
    look-ahead); `RolloutMetricsCallback` logs what the rollout side measured up to there, the look-ahead's drops
    included. Lightning appends the callbacks returned by `configure_callbacks` after the trainer's, replacing the
    trainer's own of the same types: a callback the trainer has is returned (moved) only when one before it in that
    order is added or comes after it. A `CompletionsTableCallback` and a `PreemptionCallback` are added when the
    trainer has none; they may run anywhere.
    """

    def find(cls: type) -> pl.Callback | None:
        return next((c for c in present if isinstance(c, cls)), None)

    returned: list[pl.Callback] = []
    position = -1
    for cls in ORDERED:
        own = find(cls)
        if own is None:
            returned.append(cls())
        elif returned or present.index(own) < position:
            returned.append(own)
        else:
            position = present.index(own)
    if find(CompletionsTableCallback) is None:
        returned.append(CompletionsTableCallback())
    if find(PreemptionCallback) is None:
        returned.append(PreemptionCallback())
    return returned
