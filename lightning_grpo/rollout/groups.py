"""A group's rollouts as the rollout loop collects them: one finished conversation (`Rollout`), TRL's
`RolloutGroup` with what GRPO adds (`Group`), and `assemble`, which fills a group from its rollouts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .._trl import RolloutGroup, TrainingSequence


@dataclass(slots=True)
class Rollout:
    """One finished conversation of a group, as `_generate_one` returns it plus its environment reward."""

    prompt: str | list[dict[str, Any]]  # a string for a raw-text prompt
    completion: str | list[dict[str, Any]]  # likewise
    completion_ids: list[int]
    sequences: list[TrainingSequence]
    tool_calls: int
    tool_failures: int
    rollout_reward: float | None
    env_reward: tuple[type, float | None] | None  # (environment class, reward; None when get_reward failed)
    model_version: int | None  # oldest weights that sampled a turn; None: no turn was sampled
    env_failed: bool = False  # its environment's reset failed: every reward column is NaN
    truncated: bool | None = None  # the last turn stopped at its token limit; None: unknown (judged by its EOS)


@dataclass(slots=True)
class Group(RolloutGroup):
    """TRL's `RolloutGroup` plus which rollouts' environments failed to reset (scored NaN in every column) and
    whether each completion was truncated (an EOS id or a stop string ended it, or not)."""

    env_failed: list[bool] = field(default_factory=list)
    truncated: list[bool | None] = field(default_factory=list)


def assemble(group: RolloutGroup, rollouts: list[Rollout]) -> RolloutGroup:
    """Fill `group` from its finished rollouts.

    The group's version becomes that of the oldest weights that sampled any turn of any of its conversations (a
    sync can land while a group is being generated, or between the turns of one conversation), so staleness is never
    under-counted and a group tagged with the new version was sampled by the new weights only.
    """
    versions = [r.model_version for r in rollouts if r.model_version is not None]
    if versions:
        group.model_version = min(versions)
    for rollout in rollouts:
        group.prompts.append(rollout.prompt)
        group.completions.append(rollout.completion)
        group.completions_ids.append(rollout.completion_ids)
        group.completions_sequences.append(rollout.sequences)
        group.tool_call_counts.append(rollout.tool_calls)
        group.tool_failure_counts.append(rollout.tool_failures)
        group.rollout_rewards.append(rollout.rollout_reward)
        group.env_rewards.append(rollout.env_reward)
        if isinstance(group, Group):
            group.env_failed.append(rollout.env_failed)
            group.truncated.append(rollout.truncated)
    return group
