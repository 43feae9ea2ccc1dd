"""Real `Trainer.fit` runs of `GRPOModule` on given steps, without a rollout child: `ReplaySource` is the package's
`StepReplay` (a second implementation of `lightning_grpo.RolloutSource`) over `StepBatch`es planned by the real
`StepPlanner` and packed by the real `ProgressCollator` (see `planned_steps`)."""

from __future__ import annotations

from collections.abc import Sequence

from helpers.transfers import RecordingTransfer
from lightning_grpo import RolloutContract
from lightning_grpo.models import char_tokenizer
from lightning_grpo.pipeline.batch import StepBatch
from lightning_grpo.training.replay import StepReplay


class ReplaySource(StepReplay):
    """`StepReplay` pushing through a `RecordingTransfer` (what it sent is in `transfer`)."""

    def __init__(self, steps: list[StepBatch], contract: RolloutContract) -> None:
        self.transfer = RecordingTransfer()
        super().__init__(steps, contract, weight_transfer=self.transfer)


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
    from helpers.tiny import collate_step, plan_step

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
    from helpers.tiny import cpu_trainer

    source = ReplaySource(steps, contract or tiny_contract())
    cpu_trainer(**trainer_options).fit(module, datamodule=source, ckpt_path=ckpt_path)
    return source


def replay_groups(steps: int, per_step: int = 2) -> list[list]:
    """`steps` steps' worth of `per_step` groups (random generator log-probabilities, signed advantages)."""
    from helpers.tiny import rollout_group

    out = []
    for s in range(steps):
        step = []
        for g in range(per_step):
            group_id = s * per_step + g
            group = rollout_group(group_id, 5, [4, 6, 3, 5], seed=group_id, advantage=0.0)
            for k, sample in enumerate(group):
                sample.advantage = float((-1) ** (k + g)) * (0.3 + 0.2 * k)
            step.append(group)
        out.append(step)
    return out


def replay_steps(steps: int, **kwargs) -> list[StepBatch]:
    """`replay_groups(steps)` as rank 0's planned `StepBatch`es (`planned_steps`' options)."""
    return [rank[0] for rank in planned_steps(replay_groups(steps), **kwargs)]
