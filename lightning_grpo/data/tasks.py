"""The builtin tasks, in one table: the `dataset` values whose rows are generated in code, not read from a file.

Each `BuiltinTask` says how to generate its rows, how to check its `dataset_options`, and which columns its rows carry
for the reward functions. `load_prompts` (`sources.py`) generates a task's rows from it, and `check_dataset_options`
(`options.py`) checks a data module's options against it, so a new task is one entry here.

| `dataset`                | rows                                                 | `dataset_options`                  |
|--------------------------|------------------------------------------------------|------------------------------------|
| `"arithmetic"`           | `arithmetic.arithmetic_dataset`                      | `template`                         |
| `"calculator"`           | `calculator.calculator_dataset` (for the tool)       | none                               |
| `"number_guess"`         | `number_guess.number_guess_dataset` (environment)    | `high`                             |
| `"reasoning_gym:<task>"` | `reasoning_gym.reasoning_gym_dataset`                | the task's config, `system_prompt` |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from datasets import Dataset

from . import arithmetic, calculator, number_guess, reasoning_gym

#: Rows a fixed builtin task generates when `dataset_size` is not set (a reasoning-gym task makes its own default).
DEFAULT_SIZE = 600


@dataclass(frozen=True, slots=True)
class BuiltinTask:
    """A prompt dataset generated in code.

    `load(source, size, seed, options)` generates the rows (`size=None`: the task's default); `option_problems(source,
    options)` says what is wrong with `dataset_options` for it, without generating anything (None: it takes no
    options); `columns` are the columns besides `prompt` that its rows carry for the reward functions.
    """

    name: str
    load: Callable[[str, int | None, int, dict[str, Any]], Dataset]
    option_problems: Callable[[str, dict[str, Any]], list[str]] | None
    columns: tuple[str, ...]


def _arithmetic(source: str, size: int | None, seed: int, options: dict[str, Any]) -> Dataset:
    return arithmetic.arithmetic_dataset(size or DEFAULT_SIZE, seed, **options)


def _calculator(source: str, size: int | None, seed: int, options: dict[str, Any]) -> Dataset:
    return calculator.calculator_dataset(size or DEFAULT_SIZE, seed)


def _number_guess(source: str, size: int | None, seed: int, options: dict[str, Any]) -> Dataset:
    return number_guess.number_guess_dataset(size or DEFAULT_SIZE, seed, **options)


def _reasoning_gym(source: str, size: int | None, seed: int, options: dict[str, Any]) -> Dataset:
    return reasoning_gym.reasoning_gym_dataset(source, size=size, seed=seed, options=options)


#: The fixed builtin tasks, by their `dataset` name.
TASKS: dict[str, BuiltinTask] = {
    task.name: task
    for task in (
        BuiltinTask(
            "arithmetic", _arithmetic, lambda _, options: arithmetic.option_problems(options), ("answer", "task")
        ),
        BuiltinTask("calculator", _calculator, None, ("answer", "expression", "task")),
        BuiltinTask(
            "number_guess", _number_guess, lambda _, options: number_guess.option_problems(options), ("secret", "high")
        ),
    )
}
#: Every `"reasoning_gym:<task>"` (one of reasoning-gym's procedural tasks).
REASONING_GYM = BuiltinTask(
    reasoning_gym.PREFIX,
    _reasoning_gym,
    reasoning_gym.option_problems,
    ("question", "answer", "metadata", "gym_task", "gym_options"),
)
#: The `dataset` names of the fixed builtin tasks.
BUILTIN_DATASETS = tuple(TASKS)


def builtin_task(source: Any) -> BuiltinTask | None:
    """The builtin task a `dataset` value names (`"arithmetic"`, `"reasoning_gym:countdown"`, ...), or None when it
    names rows (a file, a `Dataset`, a Hub dataset)."""
    if not isinstance(source, str):
        return None
    return REASONING_GYM if reasoning_gym.is_reasoning_gym(source) else TASKS.get(source)
