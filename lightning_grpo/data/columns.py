"""What a prompt dataset holds: a `prompt` column, an `answer` where a reward checks one, and the columns each reward
function reads.

`ANSWER_INSTRUCTION` is the sentence the builtin tasks and the GSM8K/MATH presets end a question with, so that
`lightning_grpo.rewards.accuracy` finds the answer in the completion's `\\boxed{}`. `columns_needed_by(func)` is what
a reward function cannot be called without; `check_columns` and `check_columns_for_rewards` fail early, naming the
columns a dataset lacks.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence

from datasets import Dataset

ANSWER_INSTRUCTION = "Put the final answer in \\boxed{}."
#: What the rollout loop passes every reward function besides the dataset's columns.
REWARD_ARGUMENTS = frozenset({"completions", "prompts", "completion_ids"})


def check_columns(dataset: Dataset, required: set[str], *, source: str = "the prompt dataset") -> None:
    """Raise `ValueError` naming the missing columns (and the ones present) when `dataset` lacks any of `required`."""
    missing = sorted(required - set(dataset.column_names))
    if missing:
        raise ValueError(
            f"{source} has no column(s) {missing}; it has {dataset.column_names}. Every dataset needs a `prompt` "
            "column (chat messages or a string) plus the columns your reward functions read."
        )


def columns_needed_by(func: Callable) -> set[str]:
    """The dataset columns `func` cannot be called without: its named parameters without a default, other than
    `completions`, `prompts` and `completion_ids` (empty when its signature cannot be read)."""
    try:
        # a partial's own signature (its bound keywords have defaults), even when update_wrapper points past it
        parameters = inspect.signature(func, follow_wrapped=not isinstance(func, functools.partial)).parameters.values()
    except (TypeError, ValueError):
        return set()
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    required = {p.name for p in parameters if p.kind in named and p.default is inspect.Parameter.empty}
    return required - REWARD_ARGUMENTS


def check_columns_for_rewards(dataset: Dataset, reward_funcs: Sequence[Callable], *, source: str) -> None:
    """Raise `ValueError` naming a reward function and the dataset columns it needs that `dataset` lacks."""
    from .._trl import get_callable_name

    problems = []
    for func in reward_funcs:
        missing = sorted(columns_needed_by(func) - set(dataset.column_names))
        if missing:
            problems.append(f"reward {get_callable_name(func)!r} needs column(s) {missing}")
    if problems:
        raise ValueError(
            f"{source}: {'; '.join(problems)}, but the dataset has {dataset.column_names}. Add the column(s), or use "
            "reward functions that read the columns it has."
        )
