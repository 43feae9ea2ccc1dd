"""How many prompt groups one optimizer step holds under the data module's options, and the start-up check that a
group fits one step at all (`check_step_capacity`, with the knob to change)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .planner import check_step_capacity


def groups_per_step(hp: Any, world_size: int, longest_prompt: Callable[[], int]) -> int:
    """Prompt groups in one optimizer step (the planner's cap and the pacing unit).

    Args:
        hp: the data module's options (`gradient_accumulation_steps`, `token_budget`, `num_generations`,
            `max_completion_length`, `samples_per_row`).
        world_size: the trainer's processes.
        longest_prompt: the longest rendered prompt in tokens (called only with a `token_budget`).
    """
    rows = hp.gradient_accumulation_steps * world_size
    if hp.token_budget > 0:
        per_row = hp.token_budget // (longest_prompt() + hp.num_generations * hp.max_completion_length)
        return max(1, rows * max(1, per_row))
    return max(1, rows * (hp.samples_per_row or hp.num_generations) // hp.num_generations)


def check_group_fits(hp: Any, world_size: int, longest_prompt: Callable[[], int]) -> None:
    """`check_step_capacity` under the data module's options (see `groups_per_step` for the arguments).

    Raises:
        ValueError: a group can never fit one optimizer step; the message names the option to change.
    """
    longest = longest_prompt() + hp.max_completion_length if hp.token_budget > 0 else None
    check_step_capacity(
        hp.num_generations,
        hp.gradient_accumulation_steps,
        world_size,
        hp.token_budget,
        hp.samples_per_row or hp.num_generations,
        max_sample_tokens=longest,
    )
