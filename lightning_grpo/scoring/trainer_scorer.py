"""TrainerScorer: one reward column computed on the trainer, and the uids its features are reported under."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from ..pipeline.planner import ScoredRow
    from ..rollout.records import RolloutSample

#: `features` uids above this bound are samples; extras are encoded below -1 (see `extra_uid`); -1 is a filler.
FILLER_UID = -1
_EXTRAS_PER_GROUP = 1 << 16


def extra_uid(group_id: int, index: int) -> int:
    """The uid `features` reports for a group extra: `GroupExtra(group_id=..., index=...)` -> a negative int < -1."""
    if not 0 <= index < _EXTRAS_PER_GROUP or group_id < 0:
        raise ValueError(f"`extra_uid(group_id={group_id}, index={index})`: need group_id >= 0 and 0 <= index < 65536.")
    return -2 - (group_id * _EXTRAS_PER_GROUP + index)


def decode_extra_uid(uid: int) -> tuple[int, int]:
    """`(group_id, index)` of an `extra_uid`."""
    return divmod(-2 - uid, _EXTRAS_PER_GROUP)


class TrainerScorer(ABC):
    """One reward column computed on the trainer from a group's samples.

    `group_extras` and `collate` run on rank 0 while steps are planned and packed; `features` runs on every rank for
    every micro-batch, so it may run collective forwards (FSDP); `group_rewards` runs on every rank, on the gathered
    features. The scorer's column joins the rollout's reward columns (after them, in scorer order) in
    `compute_group_advantages`, with its weight in `reward_weights`.

    Attributes:
        name: the reward column's name (in logs: `rewards/<name>`).

    Example::

        import torch

        from lightning_grpo import GRPOModule, TrainerScorer


        class Brevity(TrainerScorer):
            # shorter completions score higher, computed on the trainer (where a
            # model's forward would run)
            name = "brevity"

            def collate(self, rows, index):
                inputs = [
                    {
                        "uids": torch.tensor([d["uid"] for d in row.samples]),
                        "lengths": torch.tensor(
                            [int(d["completion_mask"].sum()) for d in row.samples]
                        ),
                    }
                    for row in rows
                ]
                return inputs, {"uids": -1, "lengths": 0}

            def features(self, module, inputs):
                return inputs["uids"], inputs["lengths"].float()

            def group_rewards(self, sample_features, extra_features):
                return -sample_features / sample_features.max().clamp(min=1.0), {}


        module = GRPOModule("tiny-random", scorers=[Brevity()], scorer_weights=[0.5])
    """

    name: str = "trainer_score"

    def group_extras(self, samples: list[RolloutSample]) -> list[Any]:
        """Sequences scored with a group but not trained, e.g. a reference answer (rank 0, planning time).

        The planner stores each as `GroupExtra(scorer, group_id, index, value)` in one of the group's rows' `extras`;
        `collate` reads them back. Default: none.
        """
        return []

    @abstractmethod
    def collate(
        self, rows: list[ScoredRow], index: int
    ) -> tuple[list[dict[str, torch.Tensor]], Mapping[str, int | float]]:
        """Per-row input tensors for `features` and their padding values (rank 0).

        `rows` are one micro-batch's rows (row r goes to rank r); `index` is this scorer's position, which marks its
        entries in `row.extras`. Every row must yield input for `features`, also when it holds only filler samples
        (uid -1), so that collective forwards line up across ranks. Keys prefixed `c{j}_` split a row into chunks,
        each scored by its own `features` call; every row of a micro-batch must then have the same number of chunks,
        for the same reason. `packing.collate_sequences` does all of this for token sequences.

        Returns:
            `(inputs, pad_values)`: one dict of 1-D tensors per row, and the value to pad each key with.
        """

    @abstractmethod
    def features(self, module: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """`(uids, features)` of the sequences in one rank's chunk of a micro-batch (every rank).

        `module` is the LightningModule (for its device). `uids` (n,) int64 names each sequence: its `sample_uid`
        for a sample, `extra_uid(group_id, index)` for a group extra, -1 for a filler (ignored); `features` is
        `(n, ...)`. Runs under `torch.no_grad()`.
        """

    @abstractmethod
    def group_rewards(
        self, sample_features: torch.Tensor, extra_features: torch.Tensor
    ) -> tuple[torch.Tensor | np.ndarray, dict[str, float]]:
        """Rewards of a group's samples, and metrics to average over groups (every rank).

        Args:
            sample_features: `(G, ...)` the group's samples, in `sample_uid` order.
            extra_features: `(E, ...)` the group's extras, in `group_extras` order (E may be 0).

        Returns:
            `(rewards, metrics)`: `(G,)` rewards, NaN where not scored, and floats averaged over the step's groups.
        """


def resolve_scorer(scorer: Any) -> TrainerScorer:
    """A scorer instance, from an instance or an import path of an instance or of a zero-argument factory.

    Raises:
        ValueError: the path does not import, or does not give a `TrainerScorer`.
    """
    from .._imports import import_object

    if not isinstance(scorer, str):
        return scorer
    value = import_object(scorer, "scorers")
    if not isinstance(value, TrainerScorer) and callable(value):
        value = value()
    if not isinstance(value, TrainerScorer):
        raise ValueError(f"`scorers` entry {scorer!r} did not give a TrainerScorer but a {type(value).__name__}.")
    return value
