"""What `GRPODataModule` resolves before anything starts: prompt sources and their columns (`sources`), the dataset
presets (`formats`: GSM8K, MATH, prompt + answer), reasoning-gym's tasks and their scorer (`reasoning_gym`), the checks
of its options (`options`), and the tools, environments and prompt rendering of its conversations (`tooling`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._imports import lazy_exports

# `lightning_grpo.data` was one module; its public names stay importable from here.
_EXPORTS = {
    name: "sources"
    for name in (
        "ANSWER_INSTRUCTION",
        "BUILTIN_DATASETS",
        "arithmetic_dataset",
        "as_messages",
        "load_prompts",
        "reward_columns",
    )
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from .sources import (
        ANSWER_INSTRUCTION,
        BUILTIN_DATASETS,
        arithmetic_dataset,
        as_messages,
        load_prompts,
        reward_columns,
    )
