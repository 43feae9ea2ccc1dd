"""Asynchronous GRPO for language models as a PyTorch Lightning module, data module and callbacks."""

import os as _os

# TRL marks `trl.experimental` unstable on every import; we pin the TRL minor release instead.
_os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from .advantages import compute_group_advantages  # noqa: E402
from .records import SCORE_PAYLOAD, RolloutSample  # noqa: E402
from .schedule import GroupSchedule  # noqa: E402

__all__ = [
    "SCORE_PAYLOAD",
    "GroupSchedule",
    "RolloutSample",
    "compute_group_advantages",
]
