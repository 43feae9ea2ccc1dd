"""The number-guessing game's prompts (`GRPODataModule(dataset="number_guess")`): one game per row, whose secret
`lightning_grpo.environments.number_guess.NumberGuessEnv` is reset with."""

from __future__ import annotations

from typing import Any

import numpy as np
from datasets import Dataset

from ..environments.number_guess import CORRECT, TOOL_NAME

DEFAULT_HIGH = 16


def number_guess_dataset(size: int = 600, seed: int = 0, high: int = DEFAULT_HIGH) -> Dataset:
    """Games of guessing a whole number from 1 to `high`.

    Columns: `prompt` (one user message that states the rules and names the `guess` tool), `secret` (the number,
    which `NumberGuessEnv.reset` reads) and `high`. The same `(size, seed, high)` always gives the same rows.

    Raises:
        ValueError: `size` is below 1 or `high` below 2.
    """
    if size < 1 or high < 2:
        raise ValueError(f"`number_guess_dataset(size={size}, high={high})` needs size >= 1 and high >= 2.")
    rng = np.random.default_rng(seed)
    prompt = [{"role": "user", "content": rules(high)}]
    secrets = [int(s) for s in rng.integers(1, high + 1, size=size)]
    return Dataset.from_dict({"prompt": [prompt] * size, "secret": secrets, "high": [high] * size})


def option_problems(options: dict[str, Any]) -> list[str]:
    """What is wrong with `dataset_options` for `dataset="number_guess"` (its one option is `high`)."""
    if unknown := sorted(set(options) - {"high"}):
        return [f"dataset_options keys {unknown} are not options of dataset='number_guess' (its one option: 'high')"]
    high = options.get("high", DEFAULT_HIGH)
    if not isinstance(high, int) or isinstance(high, bool) or high < 2:
        return [f"dataset_options['high']={high!r} (a whole number, at least 2)"]
    return []


def rules(high: int) -> str:
    """The game's rules as the user states them."""
    return (
        f"I am thinking of a whole number from 1 to {high}. Find it with the `{TOOL_NAME}` tool: it answers "
        f"higher, lower or {CORRECT}. Use as few guesses as you can, then tell me the number."
    )
