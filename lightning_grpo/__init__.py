"""Asynchronous GRPO for language models as a PyTorch Lightning module, data module and callbacks.

Public names are imported lazily, so that a spawned worker importing one submodule (the reward pool, the rollout
child) does not pay for importing torch and Lightning.
"""

from __future__ import annotations

import importlib
import os as _os
from typing import TYPE_CHECKING

# TRL marks `trl.experimental` unstable on every import; we pin the TRL minor release instead.
_os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

# public name -> submodule that defines it
_EXPORTS = {
    "compute_group_advantages": "advantages",
    "RolloutSample": "records",
    "SCORE_PAYLOAD": "records",
    "GroupSchedule": "schedule",
    "StepBatch": "batch",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .advantages import compute_group_advantages
    from .batch import StepBatch
    from .records import SCORE_PAYLOAD, RolloutSample
    from .schedule import GroupSchedule


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lightning_grpo' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
