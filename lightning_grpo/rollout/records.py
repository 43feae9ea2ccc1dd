"""Records that cross the process boundary between the rollout child and the trainer.

Each record is a slots dataclass of ints, floats, strings and numpy arrays: torch tensors on an mp queue travel as
shared memory the sender must keep alive, so tensors are made on the trainer side only.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Messages = list[dict[str, Any]]

#: Key in `RolloutSample.extras` of the payload a trainer-scored group carries (see `GRPORolloutLoop`).
SCORE_PAYLOAD = "score_payload"
#: Key in `RolloutSample.extras` of the sample's learning signal under `scale_rewards="batch"`, which the trainer
#: scales over the optimizer step (`lightning_grpo.rollout.advantages.batch_advantages`).
LEARNING_SIGNAL = "learning_signal"
#: Key in `RolloutSample.extras` of the generator replica that sampled the sample's group (`generator_replicas` > 1).
GENERATOR_REPLICA = "generator_replica"
#: Key in `RolloutSample.extras` (True) of a group the rollout loop found without learning signal (`replace_early`):
#: the trainer drops it, and pacing counted it as consumed when it was scored (its replacement started then).
NO_SIGNAL = "no_signal"


@dataclass(slots=True)
class RolloutSample:
    """One training row of one rollout: token ids, which tokens train, the generator's logprobs, the advantage.

    Mirrors TRL 1.16's `RolloutSample` field for field, plus what our planner and progress tracking need:
    `truncated` (for `mask_truncated_completions`), `group_rows` (how many rows the whole group has, which differs
    from `num_generations` when a conversation forks) and `extras` (per-sample payloads such as `SCORE_PAYLOAD`).
    """

    prompt: Messages | str
    completion: Messages | str
    input_ids: np.ndarray  # (T,) int64: prompt + completion tokens
    completion_mask: np.ndarray  # (T,) int64: 1 = train this token, 0 = prompt or other context
    old_log_probs: (
        np.ndarray
    )  # (T,) float32: generator logprob of each token under its sampling distribution, 0 on context
    advantage: float  # NaN while pending (trainer-scored groups); 0.0 exactly when the group has no learning signal;
    # group-centred but not yet scaled under scale_rewards="batch" (the collator scales it)
    model_version: int  # policy version the group started generating with
    group_id: int  # scheduled group id (see `GroupSchedule`); one prompt drawn once
    metrics: dict[str, float] = field(default_factory=dict)  # reward, reward_std, rewards/<column>, ...
    enqueued_at: float | None = None  # wall-clock time it was put on the rollout queue
    truncated: bool = False  # the completion hit the token limit without an EOS token
    group_rows: int = 1  # rows in this sample's group, all sharing `group_id`
    extras: dict[str, Any] = field(default_factory=dict)  # e.g. {SCORE_PAYLOAD: {...}} for trainer-scored groups

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_trained_tokens(self) -> int:
        return int(self.completion_mask.sum())


def without_signal(samples: Iterable[RolloutSample]) -> bool:
    """Whether every one of `samples` has an advantage of exactly 0.0: a group whose signal is constant gets 0.0,
    never noise, and a pending (NaN) advantage is not 0. The one rule for a group without learning signal, read by
    the trainer's filter (which drops such groups) and by the rollout loop (which tags them with `replace_early`)."""
    return all(sample.advantage == 0.0 for sample in samples)
