"""Scoring validation completions with the data module's reward functions, in a process pool of their own (the
training pool lives in the rollout child, and validation runs on every rank)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .._trl import get_callable_name


class ValidationScorer:
    """Every reward function's rewards for held-out completions; the pool starts at the first call.

    Args:
        reward_funcs: the data module's reward functions (TRL's signature).
        timeout: seconds one call may take before its worker is replaced and its rewards are NaN.
    """

    def __init__(self, reward_funcs: Sequence[Callable], timeout: float) -> None:
        self.reward_funcs = list(reward_funcs)
        self.timeout = timeout
        self._pool: Any = None

    def score(self, completions: list[list[dict]], rows: list[dict]) -> dict[str, list[float]]:
        """`{reward name: rewards}` for `completions` of `rows` (their extra columns go to the functions by name)."""
        from ..rollout.reward_pool import RewardProcessPool

        if self._pool is None:
            self._pool = RewardProcessPool(self.reward_funcs, 1, timeout=self.timeout)
        columns = {key: [row[key] for row in rows] for key in rows[0] if key not in ("prompt", "completion")}
        kwargs = dict(completions=completions, prompts=[row["prompt"] for row in rows], completion_ids=None, **columns)
        futures = [self._pool.submit(i, **kwargs) for i in range(len(self.reward_funcs))]
        return {get_callable_name(f): future.result() for f, future in zip(self.reward_funcs, futures, strict=True)}

    def close(self) -> None:
        """Stop the pool (idempotent; a later `score` starts a new one)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()
