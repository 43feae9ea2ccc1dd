"""The environments of a run (TRL's `environment_factory`): pools of reusable instances, their tools, their rewards.

Used by the rollout loop in the child and by validation on the trainer, so both run an environment the same way.
`reset` and `get_reward` are guarded like tools (see `tool_calls`): one that raises or hangs past the timeout is
counted (`env/reset_errors_total`, `env/reward_errors_total`) and the rollout is scored NaN, never 0.
"""

from __future__ import annotations

import inspect
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from .chat import as_messages
from .tool_calls import Counters, Rates, call_with_timeout, error_text

log = logging.getLogger(__name__)

EnvironmentFactory = Callable[[], Any] | dict[str, Callable[[], Any]]
_RESERVED = ("reset", "get_reward")


class Environments:
    """One pool of reusable environment instances per `environment_factory` entry, probed once as TRL does.

    A factory returns an object with `reset(**row)` (its return value, unless None, is appended to the last prompt
    message), public methods (the tools of its rollouts) and optionally `get_reward()` (one reward column, named after
    its class). With a dict of factories, each row picks one by its `environment` field. Instances are reused: one is
    taken for a rollout, reset, and returned when the rollout is scored.

    Args:
        environment_factory: a factory, or a dict of them.
        probes: instances already made by the factories (TRL's loop makes one of each), used instead of making more.

    Raises:
        ValueError: an environment without a `reset` method.
    """

    def __init__(self, environment_factory: EnvironmentFactory, *, probes: dict[Any, Any] | None = None) -> None:
        self.multi = isinstance(environment_factory, dict)
        self.factories: dict[str | None, Callable[[], Any]] = (
            {name: factory for name, factory in environment_factory.items()}
            if isinstance(environment_factory, dict)
            else {None: environment_factory}
        )
        self.tools: dict[Any, list[Callable]] = {}
        self.reward_types: list[type] = []
        self._pool: dict[Any, list[Any]] = {}
        for name, factory in self.factories.items():
            instance = probes[name] if probes and name in probes else factory()
            members = dict(inspect.getmembers(type(instance), predicate=inspect.isfunction))
            if "reset" not in members:
                raise ValueError(
                    f"The environment {type(instance).__name__} (environment_factory{'' if name is None else f'[{name!r}]'}) "
                    "has no `reset` method: each environment needs `reset(**row)`, its tools as public methods and, "
                    "to be a reward column, `get_reward()`."
                )
            if "get_reward" in members and type(instance) not in self.reward_types:
                self.reward_types.append(type(instance))
            self.tools[name] = tool_methods(instance)
            self._pool[name] = [instance]

    @property
    def reward_names(self) -> list[str]:
        """The reward columns the environments add, after the reward functions': their class names."""
        return [cls.__name__ for cls in self.reward_types]

    def rewards_per_type(self, rewards: list[tuple[type, float | None] | None]) -> list[list[float | None]]:
        """Per-rollout `reward()` results as one column per reward type (`reward_names` order), None where that
        type did not score the rollout."""
        return [[r[1] if r is not None and r[0] is cls else None for r in rewards] for cls in self.reward_types]

    def all_tools(self) -> list[Callable]:
        return [tool for tools in self.tools.values() for tool in tools]

    def name_of(self, row: dict[str, Any]) -> Any:
        """The factory a dataset row uses (its `environment` field with several; None with one)."""
        if not self.multi:
            return None
        name = row.get("environment")
        if name not in self.factories:
            raise ValueError(
                f"Example has `environment={name!r}`, which is not among the environments passed to "
                f"`environment_factory`. Expected one of: {list(self.factories)}."
            )
        return name

    def acquire(self, name: Any) -> Any:
        pool = self._pool[name]
        return pool.pop() if pool else self.factories[name]()

    def release(self, name: Any, environment: Any) -> None:
        self._pool[name].append(environment)

    async def reset(
        self, environment: Any, row: dict[str, Any], *, timeout: float | None, counters: Counters, rates: Rates
    ) -> tuple[Any, bool]:
        """`(observation, ok)`: `environment.reset(**row)`; on an error or a timeout, `(None, False)`, counted."""
        kwargs = {k: v for k, v in row.items() if k != "environment"} if self.multi else dict(row)
        started = time.monotonic()
        try:
            observation = await call_with_timeout(
                environment.reset, kwargs, timeout, f"{type(environment).__name__}.reset"
            )
            return observation, True
        except Exception as error:
            counters["env/reset_errors_total"] += 1
            log.warning("environment reset failed (%s); the rollout is scored NaN", error_text(error))
            return None, False
        finally:
            rates["env/reset_s"][0] += time.monotonic() - started
            rates["env/reset_s"][1] += 1

    async def reward(
        self, environment: Any, *, timeout: float | None, counters: Counters, rates: Rates
    ) -> tuple[type, float | None] | None:
        """`(class, reward)` for an environment that owns a reward column (reward None when `get_reward` failed);
        None for one that does not."""
        if type(environment) not in self.reward_types:
            return None
        started = time.monotonic()
        try:
            reward = await call_with_timeout(
                environment.get_reward, {}, timeout, f"{type(environment).__name__}.get_reward"
            )
            return type(environment), _as_reward(reward)
        except Exception as error:
            counters["env/reward_errors_total"] += 1
            log.warning("environment get_reward failed (%s); its reward is NaN", error_text(error))
            return type(environment), None
        finally:
            rates["env/reward_s"][0] += time.monotonic() - started
            rates["env/reward_s"][1] += 1


def tool_methods(environment: Any) -> list[Callable]:
    """An environment's tools: its public methods other than `reset` and `get_reward` (bound to it)."""
    if environment is None:
        return []
    return [
        getattr(environment, name)
        for name, _ in inspect.getmembers(type(environment), predicate=inspect.isfunction)
        if name not in _RESERVED and not name.startswith("_")
    ]


def prompt_of(row: dict[str, Any], environment: Any) -> str | list[dict[str, Any]]:
    """A row's prompt as the dataset holds it; an empty user message when an environment supplies the task."""
    if "prompt" not in row and environment is not None:
        return [{"role": "user", "content": ""}]
    return row["prompt"] if isinstance(row["prompt"], str) else list(row["prompt"])


def with_observation(prompt: str | list[dict[str, Any]], observation: Any) -> str | list[dict[str, Any]]:
    """Fold an environment's reset observation into the prompt's last message (as GRPOTrainer does)."""
    if observation is None:
        return prompt
    if isinstance(prompt, str):
        if isinstance(observation, str):
            return prompt + observation
        prompt = as_messages(prompt)
    last = prompt[-1]
    content = last["content"]
    if isinstance(observation, list) and isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if isinstance(observation, str) and isinstance(content, list):
        observation = [{"type": "text", "text": observation}]
    return prompt[:-1] + [{**last, "content": content + observation}]


def _as_reward(value: Any) -> float | None:
    """A reward as a float (None stays "not scored"); anything else fails like a raising `get_reward`."""
    if value is None:
        return None
    reward = float(value)
    if not math.isfinite(reward):
        raise ValueError(f"get_reward returned {reward}; return None for 'not scored'")
    return reward
