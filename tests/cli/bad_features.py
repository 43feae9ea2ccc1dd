"""Import paths the bad-configuration tests hand `lightning-grpo fit`: tools and environment factories TRL's loop
cannot use (imported by the command in the test's process; tests/cli is on its path)."""

from __future__ import annotations

NOT_CALLABLE = 3


def untyped_tool(x):
    return x


class GuessEnv:
    """An environment whose tool has no schema: no type hints, no docstring."""

    def reset(self, **row):
        return None

    def guess(self, x):
        return x


def guess_env() -> GuessEnv:
    return GuessEnv()


def env_for(name: str) -> GuessEnv:
    return GuessEnv()


class SizedEnv:
    def __init__(self, size: int) -> None:
        self.size = size

    def reset(self, **row):
        return None


class NoReset:
    def step(self, x: int) -> int:
        """Takes a step.

        Args:
            x: how far.
        """
        return x


def no_reset() -> NoReset:
    return NoReset()
