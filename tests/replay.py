"""Real `Trainer.fit` runs of `GRPOModule` on given steps, without a rollout child: `ReplaySource` is a second
implementation of `lightning_grpo.RolloutSource` that replays `StepBatch`es (planned by the real `StepPlanner` and
packed by the real `ProgressCollator`, see `planned_steps`)."""

from __future__ import annotations

from collections.abc import Sequence

import lightning.pytorch as pl
from test_weight_sync import RecordingTransfer
from torch.utils.data import DataLoader

from lightning_grpo import RolloutContract
from lightning_grpo.models import char_tokenizer
from lightning_grpo.pipeline.batch import StepBatch
from lightning_grpo.weights.sync import WeightSync


class ReplaySource(pl.LightningDataModule):
    """Replays recorded steps to `GRPOModule` on one process: the whole `RolloutSource` protocol, nothing spawned."""

    def __init__(self, steps: list[StepBatch], contract: RolloutContract) -> None:
        super().__init__()
        self.steps = steps
        self.contract = contract
        self.transfer = RecordingTransfer()
        self.weight_sync = WeightSync(self.transfer)
        self.progress = None
        self.process_group = None
        self.finished: list[list[int]] = []
        self._stop: StepBatch | None = None

    def rollout_contract(self) -> RolloutContract:
        return self.contract

    def train_dataloader(self) -> DataLoader:
        self.weight_sync.push(self.trainer.lightning_module.policy)
        return DataLoader(self.steps, batch_size=None, collate_fn=lambda step: step)

    def finish_step(self, batch: StepBatch, *, look_ahead: bool) -> StepBatch | None:
        self.finished.append(batch.group_ids)
        if look_ahead and len(self.finished) == len(self.steps):
            self._stop = StepBatch.stop_item()
        return self._stop

    def stream_stop(self) -> StepBatch | None:
        return self._stop

    def rollout_metrics(self) -> dict[str, float]:
        return {}

    def progress_summary(self) -> None:
        return None

    def score_completions(self, completions, rows):
        raise AssertionError("the replay has no validation")


def tiny_contract(**overrides) -> RolloutContract:
    """The contract of `tests/scripts/fit_tiny.py`'s data module (tiny model, one reward column)."""
    options = dict(
        tokenizer=char_tokenizer(),
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_completion_length=8,
        reward_names=("char_sum_reward",),
        reward_weights=(1.0,),
        multi_objective_aggregation="sum_then_normalize",
        scale_rewards="group",
        mask_truncated_completions=False,
    )
    return RolloutContract(**(options | overrides))


def planned_steps(
    steps_groups: Sequence[list], *, num_processes: int = 1, micro_batches: int = 1, samples_per_row: int = 8
) -> list[list[StepBatch]]:
    """Each list of groups as one optimizer step: per rank, the `StepBatch` the real planner and collator make."""
    from packed_rows import collate_step, plan_step

    planned = []
    for groups in steps_groups:
        plan = plan_step(groups, num_processes=num_processes, steps=micro_batches, samples_per_row=samples_per_row)
        planned.append(collate_step(plan, (), num_processes=num_processes, reward_names=["char_sum_reward"]))
    return planned


def fit_replay(
    module,
    steps: list[StepBatch],
    contract: RolloutContract | None = None,
    ckpt_path: str | None = None,
    **trainer_options,
):
    """`Trainer.fit(module)` on `steps` (one process; from `ckpt_path` if given); returns the `ReplaySource`."""
    from tiny_fits import cpu_trainer

    source = ReplaySource(steps, contract or tiny_contract())
    cpu_trainer(**trainer_options).fit(module, datamodule=source, ckpt_path=ckpt_path)
    return source
