"""The number-guessing game: a multi-turn environment whose state (the secret, the guesses so far) lasts across turns.

The policy is told the secret is a whole number from 1 to `high` and finds it with the `guess` tool, which answers
`higher`, `lower` or `correct`; it then says the number and the conversation ends. `NumberGuessEnv` is the
`environment_factory` (`configs/number_guess.yaml`), `solved` a reward function that says whether a conversation found
the number (give it weight 0 to log the solve rate without training on it), `demonstration` a conversation a warm
start trains on (`lightning-grpo sft`), guessing by bisection. The prompts, one game per row, are
`lightning_grpo.data.number_guess`'s (`GRPODataModule(dataset="number_guess")`).

The reward (`get_reward`, column `NumberGuessEnv`) is for solving in few guesses: `1 - 0.1 * (guesses - 1)` once the
number is found (at least 0.5), 0 when it never is. Guesses after the number was found, or outside 1..`high`, count.
"""

from __future__ import annotations

import re
from typing import Any

TOOL_NAME = "guess"
CORRECT = "correct"
TURN_PENALTY = 0.1
MIN_SOLVED_REWARD = 0.5


class NumberGuessEnv:
    """One game: `reset(secret=..., high=...)` starts it, `guess(number)` plays, `get_reward()` scores it.

    One instance serves many rollouts (reset before each), as the rollout loop reuses environments.
    """

    def __init__(self) -> None:
        self.secret, self.high, self.solved = 0, 0, False
        self.guesses: list[int] = []

    def reset(self, secret: int, high: int = 16, **row: Any) -> None:
        """Start a game for a dataset row (its `secret` and `high`); the prompt already states the rules."""
        if not 1 <= int(secret) <= int(high):
            raise ValueError(f"`NumberGuessEnv.reset(secret={secret}, high={high})`: the secret must be in 1..high.")
        self.secret, self.high, self.guesses, self.solved = int(secret), int(high), [], False

    def guess(self, number: int) -> str:
        """Guess the secret number.

        Args:
            number: a whole number from 1 to the game's highest number.
        """
        self.guesses.append(number)
        if isinstance(number, str) and number.strip().isdigit():  # a policy may quote the number
            number = int(number)
        if self.solved:
            return f"You already found it: {self.secret}. Stop guessing and tell me the number."
        if not isinstance(number, int) or isinstance(number, bool) or not 1 <= number <= self.high:
            return f"{number!r} is not a whole number from 1 to {self.high}."
        if number == self.secret:
            self.solved = True
            return f"{CORRECT}: it is {number}"
        return "higher" if number < self.secret else "lower"

    def get_reward(self) -> float:
        """`1 - 0.1 * (guesses - 1)` (at least 0.5) once the number was found; 0 when it never was."""
        if not self.solved:
            return 0.0
        return max(MIN_SOLVED_REWARD, 1.0 - TURN_PENALTY * (len(self.guesses) - 1))


def solved(completions: list[Any], **kwargs: Any) -> list[float]:
    """1.0 for a conversation in which the `guess` tool answered `correct`, else 0.0 (the game's solve rate)."""
    return [float(any(_is_correct(message) for message in _messages(completion))) for completion in completions]


def demonstration(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The assistant's side of a game played by bisection on `row` (a row of `dataset="number_guess"`: its `secret`
    and `high`): one `guess` call per turn, then the number. The tool's answers come from a real `NumberGuessEnv` when
    the warm start renders it.
    """
    secret, high = int(row["secret"]), int(row["high"])
    low, top, replies = 1, high, []
    while True:
        number = (low + top) // 2
        call = {"type": "function", "function": {"name": TOOL_NAME, "arguments": {"number": number}}}
        replies.append({"role": "assistant", "content": "", "tool_calls": [call]})
        if number == secret:
            break
        low, top = (number + 1, top) if number < secret else (low, number - 1)
    replies.append({"role": "assistant", "content": f"The number is {secret}."})
    return replies


def _messages(completion: Any) -> list[dict[str, Any]]:
    return completion if isinstance(completion, list) else []


def _is_correct(message: dict[str, Any]) -> bool:
    content = message.get("content")
    return message.get("role") == "tool" and isinstance(content, str) and re.match(rf"{CORRECT}\b", content) is not None
