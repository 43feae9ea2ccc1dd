"""Held-out validation: the conversations the policy holds on held-out prompts (`rollouts`), and the metrics over
them, rewards weighted as in training, pass@k and mean@k (`metrics`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._imports import lazy_exports

# `lightning_grpo.validation` was one module; its public names stay importable from here.
_EXPORTS = {
    name: "rollouts" for name in ("Sampling", "ValidationRollouts", "generate", "reward_columns", "validation_rollouts")
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from .rollouts import Sampling, ValidationRollouts, generate, reward_columns, validation_rollouts
