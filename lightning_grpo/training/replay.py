"""StepReplay: a `RolloutSource` that trains `GRPOModule` on given `StepBatch`es, with no rollout child.

For what needs the module's real training path on fixed steps: tests that compare runs (the same steps on one
process and on several), benchmarks of the loss options, re-training on recorded steps. Every step is trained once,
in order; then the stream stops, so `Trainer.fit` ends by itself. Weights are pushed through the given transfer
(TRL's `WeightTransferProtocol`), as the data module pushes them to a generator.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from ..contract import RolloutContract
from ..pipeline.batch import StepBatch
from ..pipeline.ledger import RolloutStop
from ..weights.sync import WeightSync


class StepReplay(pl.LightningDataModule):
    """Replays `steps` to `GRPOModule` on one process: the whole `lightning_grpo.RolloutSource` protocol.

    Args:
        steps: one rank's `StepBatch` per optimizer step (e.g. planned by `StepPlanner` and packed by
            `ProgressCollator`).
        contract: what the module reads of the rollouts (temperature, truncation, advantage options).
        weight_transfer: where weights are pushed (a TRL `WeightTransferProtocol`).

    Attributes:
        finished: the group ids of each step that trained, in order.

    Example::

        source = StepReplay(steps, contract, weight_transfer=my_transfer)
        Trainer(max_epochs=-1).fit(GRPOModule("tiny-random"), datamodule=source)
    """

    def __init__(self, steps: list[StepBatch], contract: RolloutContract, weight_transfer: Any) -> None:
        super().__init__()
        self.steps = steps
        self.contract = contract
        self.weight_sync = WeightSync(weight_transfer)
        self.progress = None
        self.process_group = None
        self.finished: list[list[int]] = []
        self._stop: RolloutStop | None = None

    def rollout_contract(self) -> RolloutContract:
        return self.contract

    def train_dataloader(self) -> DataLoader:
        self.weight_sync.push(self.trainer.lightning_module.policy)
        return DataLoader(self.steps, batch_size=None, collate_fn=_identity)

    def finish_step(self, batch: StepBatch, *, look_ahead: bool) -> RolloutStop | None:
        self.finished.append(batch.group_ids)
        if look_ahead and len(self.finished) == len(self.steps):
            self._stop = RolloutStop()
        return self._stop

    def stream_stop(self) -> RolloutStop | None:
        return self._stop

    def rollout_metrics(self) -> dict[str, float]:
        return {}

    def progress_summary(self) -> None:
        return None

    def score_completions(self, completions: list[list[dict]], rows: list[dict]) -> dict[str, list[float]]:
        raise NotImplementedError("StepReplay has no reward functions to validate with.")


def _identity(item: Any) -> Any:
    return item
