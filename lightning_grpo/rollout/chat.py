"""Prompts to token ids, in one place: chat templates (with tools) or raw text, and a tool-call format TRL can parse.

`render_prompt` is what the rollout loop, validation and the data module's token counting all call, so a prompt
becomes the same ids everywhere. A prompt is either chat messages (always rendered with the chat template) or a
string: raw text (TRL's "standard" format, tokenized as is) or one user message, as `prompt_format` says.

`ensure_tool_parser` makes a tokenizer ready for tool calling: its chat template must write tool calls and tool
results, and TRL's response parser must read the calls back from the policy's tokens. Templates TRL knows get TRL's
parser; a template that already writes Hermes-style calls (`<tool_call>{json}</tool_call>`, as the tiny model's does)
gets TRL's Hermes parser; a ChatML template that cannot express tools at all (SmolLM2's) is replaced by
`HERMES_CHATML_TEMPLATE`, keeping its default system prompt.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from typing import Any, Literal, get_args

from .._trl import (
    add_response_schema,
    get_training_chat_template,
    hermes_response_template,
    is_chat_template_prefix_preserving,
    parse_response,
    supports_tool_calling,
)

log = logging.getLogger(__name__)

PromptFormat = Literal["auto", "chat", "text"]

# ChatML with Hermes-style tools (Qwen2.5's format, without its default system prompt): the tool schemas in the
# system message, each call as `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`, tool results as
# `<tool_response>` blocks in a user turn. `{default_system}` is filled in by `hermes_chatml_template`.
_HERMES_CHATML = (
    "{%- set default_system = DEFAULT_SYSTEM %}"
    "{%- if messages and messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
    "{%- else %}{%- set system = default_system %}{%- endif %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}{%- if system %}{{- system + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif system %}{{- '<|im_start|>system\\n' + system + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- set call = tool_call.function if tool_call.function is defined else tool_call %}"
    "{{- '\\n<tool_call>\\n' + ({'name': call.name, 'arguments': call.arguments} | tojson) + '\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

#: The ChatML tool template with no default system prompt (see `hermes_chatml_template`).
HERMES_CHATML_TEMPLATE = _HERMES_CHATML.replace("DEFAULT_SYSTEM", "''")

_CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")
_DEFAULT_SYSTEM = re.compile(r"<\|im_start\|>system(?:\\n|\n)(.*?)<\|im_end\|>", re.DOTALL)


def hermes_chatml_template(default_system: str = "") -> str:
    """The ChatML tool template, with `default_system` as the system prompt when a conversation has none."""
    literal = "'" + default_system.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return _HERMES_CHATML.replace("DEFAULT_SYSTEM", literal)


def as_messages(prompt: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A prompt as chat messages: a plain string becomes one user message (see `render_prompt` for raw text)."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def uses_raw_text(prompt: Any, tokenizer: Any, prompt_format: PromptFormat = "auto") -> bool:
    """Whether `prompt` is tokenized as raw text: a string, with `prompt_format="text"` or, with `"auto"`, a tokenizer
    that has no chat template. Chat messages never are."""
    if not isinstance(prompt, str) or prompt_format == "chat":
        return False
    return prompt_format == "text" or not has_chat_template(tokenizer)


def render_prompt(
    tokenizer: Any,
    prompt: str | list[dict[str, Any]],
    *,
    prompt_format: PromptFormat = "auto",
    tools: Sequence[Callable | dict] | None = None,
    chat_template: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The token ids the policy continues from: raw text as the tokenizer encodes it (TRL's standard format), or the
    conversation rendered with the chat template, its tool schemas and the assistant's generation prompt.

    Args:
        tokenizer: the policy's tokenizer.
        prompt: chat messages, or a string (see `uses_raw_text`).
        prompt_format: `"auto"`, `"chat"` or `"text"` (see `GRPODataModule`).
        tools: tools whose schemas the template renders (chat only).
        chat_template: a template to use instead of the tokenizer's own.
        chat_template_kwargs: extra variables for the template.
    """
    if uses_raw_text(prompt, tokenizer, prompt_format):
        return list(tokenizer(prompt)["input_ids"])
    return list(
        tokenizer.apply_chat_template(
            as_messages(prompt),
            add_generation_prompt=True,
            return_dict=False,
            tools=list(tools) if tools else None,  # None, not []: some templates render tool boilerplate for []
            chat_template=chat_template,
            **(chat_template_kwargs or {}),
        )
    )


def prompt_problems(prompt: Any, tokenizer: Any, prompt_format: PromptFormat, *, tools: bool) -> list[str]:
    """What is wrong with rendering prompts like `prompt` with this tokenizer and these options (empty if nothing)."""
    problems = []
    if prompt_format not in get_args(PromptFormat):
        problems.append(f"prompt_format={prompt_format!r} is not one of {list(get_args(PromptFormat))}")
        return problems
    raw = uses_raw_text(prompt, tokenizer, prompt_format)
    if not raw and not has_chat_template(tokenizer):
        why = "prompt_format='chat'" if isinstance(prompt, str) else "the prompts are chat messages"
        problems.append(
            f"{why} but the tokenizer has no chat template: give the tokenizer one (`tokenizer.chat_template`), or "
            "use string prompts with prompt_format='auto' or 'text' (raw text)"
        )
    if raw and tools:
        problems.append(
            "tools and environments need chat prompts (the chat template renders the tool calls and results), but "
            "the prompts are raw text: use chat messages or prompt_format='chat', with a tokenizer that has a "
            "chat template"
        )
    return problems


def conversation_chat_template(tokenizer: Any, tools: Sequence[Any] | None) -> str | None:
    """The template multi-turn rollouts render with: None (the tokenizer's own) unless tools are used and it does not
    preserve prefixes, then TRL's training template for it (TRL's rule; it raises for templates it cannot patch)."""
    if tools and not is_chat_template_prefix_preserving(tokenizer):
        return get_training_chat_template(tokenizer)
    return None


def ensure_tool_parser(tokenizer: Any) -> str | None:
    """Make `tokenizer` render tool calls and TRL parse them back; returns a note when its chat template was replaced.

    Raises:
        ValueError: the tokenizer has no template or parser TRL can use, and it is not a ChatML tokenizer whose
            template could be replaced; the message says what to set.
    """
    if _has_parser(tokenizer) and supports_tool_calling(tokenizer):
        return None
    if has_chat_template(tokenizer) and supports_tool_calling(tokenizer):
        try:
            add_response_schema(tokenizer)
            return None
        except ValueError:
            pass  # a template TRL does not know; it may still write Hermes-style calls
        if _reads_back_hermes_calls(tokenizer):
            tokenizer.response_template = hermes_response_template
            return None
    vocab = tokenizer.get_vocab()
    if all(token in vocab for token in _CHATML_TOKENS):
        match = _DEFAULT_SYSTEM.search(tokenizer.chat_template or "")
        tokenizer.chat_template = hermes_chatml_template(match.group(1) if match else "")
        tokenizer.response_template = hermes_response_template
        return (
            "The tokenizer's chat template cannot express tool calls, so it was replaced by a ChatML template with "
            "Hermes-style tool calls (<tool_call>{json}</tool_call>, the format Qwen2.5 uses) that keeps its default "
            "system prompt; TRL's Hermes parser reads the calls."
        )
    raise ValueError(
        "Tool calling needs a chat template that renders tool calls and tool results, and a response parser TRL can "
        "read them with; this tokenizer has neither (and is not ChatML, whose template could be replaced). Set "
        "`tokenizer.chat_template` to a template with tool support and `tokenizer.response_template` (see "
        "transformers' chat response-parsing docs), or use a model whose template TRL knows (Qwen, Llama 3.1+)."
    )


def _has_parser(tokenizer: Any) -> bool:
    return getattr(tokenizer, "response_template", None) is not None or bool(
        getattr(tokenizer, "response_schema", None)
    )


def _reads_back_hermes_calls(tokenizer: Any) -> bool:
    """Whether TRL's Hermes parser reads back, from the template's own rendering, the tool call the template wrote."""
    call = {"type": "function", "function": {"name": "probe_tool", "arguments": {"key": "value"}}}
    prompt = [{"role": "user", "content": "hi"}]
    try:
        prefix = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_dict=False)
        full = tokenizer.apply_chat_template(
            [*prompt, {"role": "assistant", "content": "", "tool_calls": [call]}], return_dict=False
        )
    except Exception:  # a template that fails on a tool call cannot be used for tools
        return False
    if full[: len(prefix)] != list(prefix):
        return False
    previous = getattr(tokenizer, "response_template", None)
    tokenizer.response_template = hermes_response_template
    try:
        parsed = parse_response(tokenizer, full[len(prefix) :], prefix=prefix)
    finally:
        tokenizer.response_template = previous
    return parsed.get("tool_calls") == [call]
