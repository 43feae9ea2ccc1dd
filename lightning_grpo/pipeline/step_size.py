"""How many prompt groups one optimizer step holds under the data module's options, and the start-up check that a
group fits one step at all (`check_step_capacity`, with the knob to change)."""

from __future__ import annotations

from collections.abc import Callable

from ..options import DataModuleOptions
from .planner import check_step_capacity


def groups_per_step(options: DataModuleOptions, world_size: int, longest_prompt: Callable[[], int]) -> int:
    """Prompt groups in one optimizer step (the planner's cap and the pacing unit).

    Args:
        options: the data module's options (`gradient_accumulation_steps`, `token_budget`, `samples_per_row`,
            `num_generations`, `max_completion_length`).
        world_size: the trainer's processes.
        longest_prompt: the longest rendered prompt in tokens (called only with a `token_budget`).
    """
    steps, group = options.steps, options.sampling.num_generations
    rows = steps.gradient_accumulation_steps * world_size
    if steps.token_budget > 0:
        per_row = steps.token_budget // (longest_prompt() + group * options.sampling.max_completion_length)
        return max(1, rows * max(1, per_row))
    return max(1, rows * (steps.samples_per_row or group) // group)


def check_group_fits(options: DataModuleOptions, world_size: int, longest_prompt: Callable[[], int]) -> None:
    """`check_step_capacity` under the data module's options (see `groups_per_step` for the arguments).

    Raises:
        ValueError: a group can never fit one optimizer step; the message names the option to change.
    """
    steps, sampling = options.steps, options.sampling
    longest = longest_prompt() + sampling.max_completion_length if steps.token_budget > 0 else None
    check_step_capacity(
        sampling.num_generations,
        steps.gradient_accumulation_steps,
        world_size,
        steps.token_budget,
        steps.samples_per_row or sampling.num_generations,
        max_sample_tokens=longest,
    )
