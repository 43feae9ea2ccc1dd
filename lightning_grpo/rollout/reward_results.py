"""What one reward call came to: its result checked (one number or `None` per completion), or why it has none.

Shared by the reward pool's workers and the reward calls that stay in the rollout process (`reward_calls`), so a
reward is judged the same wherever it runs. Imports only the standard library.
"""

from __future__ import annotations

import numbers
import traceback
from collections.abc import Callable
from typing import Any

_NAN = float("nan")

#: What one reward call came to, for the caller: (kind "ok" | "error", rewards, message, site, traceback).
Outcome = tuple[str, list[float] | None, str, str, str]


def run_reward(call: Callable[[], Any], size: int) -> Outcome:
    """Runs one reward call (`call()` returns its result) and checks the result: one reward per completion.

    A call that raises is an "error" with its message, the site it raised at (to group identical errors) and its
    traceback; a result that is not `size` numbers or `None`s is an "error" whose site is "result".
    """
    try:
        result = call()
    except BaseException as err:
        frame = traceback.extract_tb(err.__traceback__)[-1]
        return "error", None, f"{type(err).__name__}: {err}", f"{frame.filename}:{frame.lineno}", traceback.format_exc()
    try:
        return "ok", _as_rewards(result, size), "", "", ""
    except Exception as err:
        return "error", None, str(err), "result", ""


def _as_rewards(result: Any, size: int) -> list[float]:
    values = result.tolist() if hasattr(result, "tolist") else result  # numpy arrays and tensors
    if not isinstance(values, list | tuple) or len(values) != size:
        raise TypeError(f"it returned {_short_repr(result)}; expected a list of {size} floats, one per completion.")
    rewards = []
    for value in values:
        if value is None:
            rewards.append(_NAN)
        elif isinstance(value, numbers.Real):
            rewards.append(float(value))
        else:
            raise TypeError(
                f"it returned {_short_repr(result)}, which holds {value!r}; rewards must be floats or None."
            )
    return rewards


def _short_repr(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
