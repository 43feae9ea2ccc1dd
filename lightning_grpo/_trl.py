"""The one place that imports TRL 1.16's private async-GRPO names, so a TRL upgrade breaks only this module.

`trl>=1.16,<1.17` is pinned because `trl.experimental.async_grpo` is private API that changes between releases.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from trl.chat_template_utils import add_response_schema  # noqa: E402
from trl.experimental.async_grpo.async_rollout_worker import (  # noqa: E402
    RolloutGroup,
    TrainingSequence,
    _AsyncRolloutLoop,
    _child_main,
)
from trl.trainer.utils import get_callable_name, is_async_callable  # noqa: E402

__all__ = [
    "RolloutGroup",
    "TrainingSequence",
    "_AsyncRolloutLoop",
    "_child_main",
    "add_response_schema",
    "get_callable_name",
    "is_async_callable",
]
