"""ScoringCollator: the progress collator plus each trainer scorer's inputs; `make_step_collator` picks the one a run
needs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..options import AdvantageEstimator, ScaleRewards
from ..pipeline.batch import MicroBatch
from ..pipeline.collating import ProgressCollator
from .trainer_scorer import TrainerScorer

if TYPE_CHECKING:
    from ..pipeline.ledger import RolloutProgress
    from ..pipeline.planner import ScoredRow


class ScoringCollator(ProgressCollator):
    """TRL's collator plus what `score_step` needs on every rank.

    `ProgressCollator`'s packed rows (with the samples' uids, truncation flags and rollout reward columns), plus
    each scorer's `collate(rows, index)` output under `s{index}_` keys of the rank's micro-batch. Rows are not padded
    across ranks: each rank receives its own dicts.

    Args:
        progress: the run's `RolloutProgress`.
        scorers: the trainer scorers, in `s{index}_` order (the planner's `scorers`).
        **kwargs: `ProgressCollator`'s `num_processes`, `pad_token_id` and `reward_names`.
    """

    def __init__(
        self,
        progress: RolloutProgress | None = None,
        scorers: Sequence[TrainerScorer] = (),
        **kwargs: Any,
    ) -> None:
        super().__init__(progress, **kwargs)
        self.scorers = list(scorers)

    def collate_micro_batch(self, rows: list[ScoredRow]) -> list[MicroBatch]:
        batches = super().collate_micro_batch(rows)
        for index, scorer in enumerate(self.scorers):
            inputs, _ = scorer.collate(rows, index)
            if len(inputs) != len(rows):
                raise ValueError(
                    f"{type(scorer).__name__}.collate returned inputs for {len(inputs)} rows, not {len(rows)}: every "
                    "row (filler rows too) must get input, so that collective forwards line up across ranks."
                )
            for batch, row_inputs in zip(batches, inputs, strict=True):
                batch.update({f"s{index}_{key}": value for key, value in row_inputs.items()})
        return batches


def make_step_collator(
    progress: RolloutProgress,
    *,
    scorers: Sequence[TrainerScorer],
    num_processes: int,
    pad_token_id: int,
    reward_names: Sequence[str],
    scale_rewards: ScaleRewards,
    advantage_estimator: AdvantageEstimator,
) -> ProgressCollator:
    """The collator of the rollout session's pipeline: a `ScoringCollator` when there are trainer scorers (their
    inputs travel in each micro-batch), else a `ProgressCollator` (see `lightning_grpo.pipeline.session`)."""
    kwargs: dict[str, Any] = dict(
        num_processes=num_processes,
        pad_token_id=pad_token_id,
        reward_names=reward_names,
        scale_rewards=scale_rewards,
        advantage_estimator=advantage_estimator,
    )
    if not scorers:
        return ProgressCollator(progress, **kwargs)
    return ScoringCollator(progress, scorers=scorers, **kwargs)
