"""Tools, environments and prompt rendering as `GRPODataModule` resolves them: import paths, early checks, and the
one `ConversationSpec` that the rollout loop's options, validation and the data module's token counting come from.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .._imports import import_object, resolve_callable
from ..rollout.chat import PromptFormat, conversation_chat_template, render_prompt
from ..rollout.conversation import ConversationOptions
from ..rollout.environments import Environments

ToolSpec = str | Callable
FactorySpec = str | Callable[[], Any]


@dataclass(frozen=True)
class ConversationSpec:
    """How the run's prompts become conversations with the policy: the same for training rollouts and validation.

    Attributes:
        tokenizer: the policy's tokenizer (with a tool-calling template and parser when tools are used).
        prompt_format: `"auto"`, `"chat"` or `"text"` (see `GRPODataModule`).
        tools: standalone tools, every rollout can call them.
        environment_factory: None, a factory of environments, or a dict of them (TRL's `environment_factory`).
        max_tool_calling_iterations: tool rounds before a conversation that keeps calling tools is cut off.
        tool_timeout: seconds a tool call, `reset` or `get_reward` may take.
    """

    tokenizer: Any
    prompt_format: PromptFormat = "auto"
    tools: tuple[Callable, ...] = ()
    environment_factory: Any = None
    max_tool_calling_iterations: int | None = None
    tool_timeout: float | None = 60.0

    @property
    def uses_tools(self) -> bool:
        return bool(self.tools) or self.environment_factory is not None

    @functools.cached_property
    def environments(self) -> Environments | None:
        """The environments on this process (made on first use: one probe instance per factory), their tools checked
        as `tools` are (a factory function's instances are seen only here)."""
        if self.environment_factory is None:
            return None
        environments = Environments(self.environment_factory)
        for name, tools in environments.tools.items():
            for tool in tools:
                _check_schema(tool, "environment_factory" if name is None else f"environment_factory[{name!r}]")
        return environments

    @property
    def reward_names(self) -> list[str]:
        """The reward columns the environments add (after the reward functions')."""
        return self.environments.reward_names if self.environments is not None else []

    def tools_for(self, row: dict[str, Any]) -> list[Callable]:
        """The tools a row's rollouts see: the standalone ones plus its environment's."""
        environments = self.environments
        if environments is None:
            return list(self.tools)
        return [*self.tools, *environments.tools[environments.name_of(row)]]

    @functools.cached_property
    def options(self) -> ConversationOptions:
        """The rendering and bounds a `Conversation` takes."""
        every_tool = [*self.tools, *(self.environments.all_tools() if self.environments is not None else [])]
        return ConversationOptions(
            tokenizer=self.tokenizer,
            prompt_format=self.prompt_format,
            chat_template=conversation_chat_template(self.tokenizer, every_tool),
            max_tool_calling_iterations=self.max_tool_calling_iterations,
        )

    def render(self, row: dict[str, Any]) -> list[int]:
        """The token ids of a row's first turn (before any environment observation)."""
        options = self.options
        return render_prompt(
            self.tokenizer,
            row["prompt"],
            prompt_format=self.prompt_format,
            tools=self.tools_for(row),
            chat_template=options.chat_template,
        )

    def loop_options(self) -> dict[str, Any]:
        """The rollout loop's arguments for this spec (TRL's names for TRL's options)."""
        return {
            "tools": list(self.tools) or None,
            "environment_factory": self.environment_factory,
            "max_tool_calling_iterations": self.max_tool_calling_iterations,
            "tool_timeout": self.tool_timeout,
            "prompt_format": self.prompt_format,
        }


def resolve_tools(specs: Sequence[ToolSpec] | None) -> tuple[Callable, ...]:
    """Tools from callables or import paths, each checked to have the schema TRL renders into the prompt.

    Raises:
        ValueError: a path that does not import, a tool without type hints or an `Args:` docstring, two tools with
            one name.
    """
    tools = tuple(resolve_callable(spec, "tools") for spec in specs or ())
    names = [getattr(tool, "__name__", repr(tool)) for tool in tools]
    if len(set(names)) != len(names):
        raise ValueError(f"`GRPODataModule(tools=...)` has two tools named alike ({names}); tools are called by name.")
    for tool in tools:
        _check_schema(tool, "tools")
    return tools


def resolve_environment_factory(spec: FactorySpec | dict[str, FactorySpec] | None) -> Any:
    """An environment factory (or a dict of them) from callables or import paths; a class is checked without making
    an instance (it needs `reset`, and schemas for its tool methods).

    Raises:
        ValueError: a path that does not import, a factory that is not callable or not with zero arguments, a class
            without `reset` or with a tool method TRL cannot render.
    """
    if spec is None:
        return None
    if isinstance(spec, dict):
        return {name: _resolve_factory(value, f"environment_factory[{name!r}]") for name, value in spec.items()}
    return _resolve_factory(spec, "environment_factory")


def _resolve_factory(spec: FactorySpec, what: str) -> Callable[[], Any]:
    factory = import_object(spec, what) if isinstance(spec, str) else spec
    if not callable(factory):
        raise ValueError(f"`GRPODataModule({what}={spec!r})` is not callable: pass a class or a function that returns "
                         "an environment.")  # fmt: skip
    _check_no_arguments(factory, what)
    if isinstance(factory, type):
        members = dict(inspect.getmembers(factory, predicate=inspect.isfunction))
        if "reset" not in members:
            raise ValueError(
                f"`GRPODataModule({what}={factory.__name__})` has no `reset` method: an environment needs "
                "`reset(**row)`, its tools as public methods and, for a reward column, `get_reward()`."
            )
        for name, method in members.items():
            if name not in ("reset", "get_reward") and not name.startswith("_"):
                _check_schema(method, f"{what}={factory.__name__}")
    return factory


def _check_no_arguments(factory: Callable, what: str) -> None:
    """Refuse a factory that cannot be called with no arguments (TRL and the rollout loop call `factory()`)."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin without a signature: calling it is the only check
        return
    try:
        signature.bind()
    except TypeError:
        name = getattr(factory, "__qualname__", repr(factory))
        arguments = ", ".join(signature.parameters)
        raise ValueError(
            f"`GRPODataModule({what}={name})` takes arguments ({arguments}), but an environment factory is called with "
            f"none: give them defaults, or pass a zero-argument function or `functools.partial({name}, ...)`."
        ) from None


def _check_schema(tool: Callable, what: str) -> None:
    from transformers.utils import get_json_schema

    try:
        get_json_schema(tool)
    except Exception as error:
        name = getattr(tool, "__qualname__", repr(tool))
        raise ValueError(
            f"`GRPODataModule({what})`: the tool {name} has no schema the chat template can show the policy ({error}). "
            "A tool needs type hints on its arguments and a Google-style docstring with an `Args:` section."
        ) from None
