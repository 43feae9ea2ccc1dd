"""Validation metrics over held-out prompts: rewards weighted as in training, pass@k and mean@k, NaN kept as "not
scored" (a mean over the scored completions, with the unscored fraction logged beside it, never a 0).

`ValidationTally` sums one validation epoch on one rank; `tensor()` / `metrics(totals)` let the module add the
ranks' sums with one all-reduce, so every metric is exact over all ranks' completions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from ..rollout.advantages import compute_group_advantages

_KEYS = (
    "completions",
    "scored",
    "reward_sum",
    "prompts_scored",
    "prompts_passed",
    "pass_rate_sum",
    "conversations",
    "tool_calls",
    "tool_failures",
    "loop_exhausted",
    "turns",
)


def pass_at_k(passed: Sequence[bool]) -> float:
    """1.0 when any of a prompt's scored completions passed, else 0.0 (pass@k with k = the completions drawn)."""
    return float(any(passed))


class ValidationTally:
    """Sums of one validation epoch on one rank.

    Args:
        names: the reward columns, in order (the contract's `reward_names`).
        weights: one weight per column (the contract's `reward_weights`).
        k: completions per prompt (`num_generations_eval`), the k of `val/pass@k` and `val/mean@k`.
        pass_threshold: a completion passes when its weighted reward is at least this.
    """

    def __init__(self, names: Sequence[str], weights: Sequence[float], k: int, pass_threshold: float) -> None:
        self.names = list(names)
        self.weights = np.asarray(weights, dtype=np.float64)
        self.k = k
        self.pass_threshold = pass_threshold
        self._sums = dict.fromkeys(_KEYS, 0.0)
        self._column_sums = np.zeros(len(self.names))
        self._column_counts = np.zeros(len(self.names))

    def add_prompt(self, columns: np.ndarray) -> None:
        """One prompt's completions: `columns` is `(num_columns, k)` rewards, NaN where a column did not score."""
        rewards, _ = compute_group_advantages(columns, self.weights)  # the weighted NaN-sum, NaN where none scored
        scored = ~np.isnan(rewards)
        passed = rewards[scored] >= self.pass_threshold
        sums = self._sums
        sums["completions"] += rewards.size
        sums["scored"] += int(scored.sum())
        sums["reward_sum"] += math.fsum(rewards[scored])
        if scored.any():
            sums["prompts_scored"] += 1
            sums["prompts_passed"] += pass_at_k(passed)
            sums["pass_rate_sum"] += float(passed.mean())
        present = ~np.isnan(columns)
        self._column_sums += np.where(present, columns, 0.0).sum(axis=1)
        self._column_counts += present.sum(axis=1)

    def add_conversation(self, tool_calls: int, tool_failures: int, loop_exhausted: bool, turns: int = 1) -> None:
        """One conversation's tool use and its turns (the policy's generation calls)."""
        for key, value in (
            ("conversations", 1), ("tool_calls", tool_calls), ("tool_failures", tool_failures), ("turns", turns)
        ):  # fmt: skip
            self._sums[key] += value
        self._sums["loop_exhausted"] += float(loop_exhausted)

    def tensor(self) -> torch.Tensor:
        """This rank's sums, to add over ranks (float64)."""
        return torch.tensor([*self._sums.values(), *self._column_sums, *self._column_counts], dtype=torch.float64)

    def metrics(self, totals: torch.Tensor | None = None, *, tools: bool = False) -> dict[str, float]:
        """`val/*` from `totals` (the ranks' summed `tensor()`s; default: this rank's). NaN where nothing was scored.

        `val/reward` is the mean weighted reward over scored completions and `val/rewards/<name>` each column's mean
        over the completions it scored; `val/unscored_frac` is the fraction no column scored. `val/pass@k`: the
        fraction of prompts (with a scored completion) where one of the k completions passed; `val/mean@k`: the
        mean over those prompts of the fraction of their scored completions that passed. With `tools`, the tool
        metrics of the training rollouts under `val/tools/`, and `val/turns_mean`, the policy's turns per
        conversation (training's `rollout/turns_mean`).
        """
        values = (self.tensor() if totals is None else totals).double().tolist()
        sums = dict(zip(_KEYS, values, strict=False))
        column_sums = values[len(_KEYS) : len(_KEYS) + len(self.names)]
        column_counts = values[len(_KEYS) + len(self.names) :]
        metrics = {
            "val/reward": _ratio(sums["reward_sum"], sums["scored"]),
            "val/unscored_frac": _ratio(sums["completions"] - sums["scored"], sums["completions"]),
            f"val/pass@{self.k}": _ratio(sums["prompts_passed"], sums["prompts_scored"]),
            f"val/mean@{self.k}": _ratio(sums["pass_rate_sum"], sums["prompts_scored"]),
        }
        for name, total, count in zip(self.names, column_sums, column_counts, strict=True):
            metrics[f"val/rewards/{name}"] = _ratio(total, count)
        if tools:
            calls = sums["tool_calls"]
            metrics["val/tools/call_frequency"] = _ratio(calls, sums["conversations"])
            metrics["val/tools/failure_frequency"] = _ratio(sums["tool_failures"], calls) if calls else 0.0
            metrics["val/tools/loop_exhausted_frac"] = _ratio(sums["loop_exhausted"], sums["conversations"])
            metrics["val/turns_mean"] = _ratio(sums["turns"], sums["conversations"])
        return metrics


def check_validation_options(num_generations_eval: int, val_temperature: float, val_max_tokens: int | None) -> None:
    """Raise one `ValueError` naming every bad validation option of `GRPOModule`."""
    problems = []
    if num_generations_eval < 1:
        problems.append(f"num_generations_eval={num_generations_eval} (must be at least 1)")
    if not (val_temperature >= 0 and math.isfinite(val_temperature)):
        problems.append(f"val_temperature={val_temperature} (0 for greedy, or a positive temperature)")
    elif num_generations_eval > 1 and val_temperature == 0:
        problems.append(
            f"num_generations_eval={num_generations_eval} with val_temperature=0 (greedy validation gives "
            f"{num_generations_eval} identical completions: set val_temperature > 0 to sample them)"
        )
    if val_max_tokens is not None and val_max_tokens < 1:
        problems.append(f"val_max_tokens={val_max_tokens} (must be at least 1)")
    if problems:
        raise ValueError(f"`GRPOModule({', '.join(problems)})`.")


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else math.nan
