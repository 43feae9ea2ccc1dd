"""Demonstrations to training rows, through the rollout's own path: the same `Conversation`, chat template, response
parser, `ToolCaller` and TRL's `_chain_to_sequences` that turn a GRPO rollout into a training row.

A demonstration is the assistant's side of a conversation (`lightning_grpo.data.calculator.demonstration`): each
assistant message is written as the tokens the policy would generate for it (the chat template's rendering of the
conversation with that message, past the generation prompt, up to and including the end-of-turn token), TRL's parser
must read the same tool calls back from those tokens, and the calls run on the real tools, whose results are the
next turn's context. So the warm start trains exactly the token sequences the policy later samples in GRPO, and the
mask is the rollout's: the assistant's tokens (its end-of-turn token included) are 1, the system prompt with the
tool schemas, the question and the tool results are 0.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..data.tooling import ConversationSpec
from ..rollout.chat import ensure_tool_parser
from ..rollout.conversation import Conversation
from ..rollout.environments import prompt_of, tool_methods, with_observation
from ..rollout.tool_calls import ToolCaller

# No turn is long enough to drift (`_chain_to_sequences` forks a row past this many re-tokenized tokens).
_FORK_THRESHOLD_TOKENS = 64


@dataclass(frozen=True, slots=True)
class DemonstrationRow:
    """One demonstration as one training row."""

    input_ids: list[int]  # the whole conversation, prompt included
    completion_mask: list[int]  # 1 = the assistant's token (trained), 0 = context
    tool_calls: int  # calls the demonstration made
    tool_failures: int  # calls whose tool raised (a demonstration should have none)


def conversation_spec(tokenizer: Any, tools: Sequence[Callable], max_tool_calling_iterations: int | None = 8) -> Any:
    """The `ConversationSpec` GRPO's rollouts use for these tools (the tokenizer made ready for tool calls first)."""
    if tools:
        ensure_tool_parser(tokenizer)
    return ConversationSpec(
        tokenizer=tokenizer, tools=tuple(tools), max_tool_calling_iterations=max_tool_calling_iterations
    )


def render_rows(
    tokenizer: Any,
    rows: Any,
    demonstrate: Callable[[dict[str, Any]], list[dict[str, Any]]],
    *,
    tools: Sequence[Callable] = (),
    environment_factory: Callable[[], Any] | None = None,
    max_tool_calling_iterations: int | None = 8,
) -> list[DemonstrationRow]:
    """Every row's demonstration (`demonstrate(row)`) as a training row.

    With an `environment_factory`, each row plays against a fresh environment, reset with the row as a rollout's is
    (its observation folded into the prompt), whose public methods are the row's tools beside `tools`.

    Raises:
        KeyError: `demonstrate` needs a column the rows do not have.
        ValueError: see `render_demonstration`; an environment whose `reset` raises.
    """
    if environment_factory is None:
        spec = conversation_spec(tokenizer, tools, max_tool_calling_iterations)
        return [render_demonstration(spec, row["prompt"], demonstrate(row)) for row in rows]
    ensure_tool_parser(tokenizer)
    demonstrations = []
    for row in rows:
        environment = environment_factory()
        observation = environment.reset(**row)
        spec = conversation_spec(tokenizer, [*tools, *tool_methods(environment)], max_tool_calling_iterations)
        demonstrations.append(
            render_demonstration(spec, with_observation(prompt_of(row, environment), observation), demonstrate(row))
        )
    return demonstrations


def render_demonstration(
    spec: ConversationSpec, prompt: str | list[dict[str, Any]], replies: Sequence[dict[str, Any]]
) -> DemonstrationRow:
    """The training row of the conversation in which the assistant answers `prompt` with `replies`, one per turn.

    Args:
        spec: the run's conversation spec (`conversation_spec`).
        prompt: the chat messages the conversation starts from (the dataset row's `prompt`; a string is one user
            message, as in training, where the tokenizer has a chat template).
        replies: the assistant's messages in order; each one with `tool_calls` but the last.

    Raises:
        ValueError: a raw-text prompt; the chat template does not extend the conversation by the reply (it is not
            prefix-preserving), TRL's parser reads back other tool calls than the reply has, a reply is missing or
            left over, or the conversation drifted into more than one row.
    """
    conversation = Conversation(prompt, spec.options, tools=spec.tools)
    messages = conversation.messages  # the conversation so far (it grows with each turn)
    if messages is None:
        raise ValueError(f"A demonstration's prompt must be chat messages, not raw text ({prompt!r:.80}).")
    caller = ToolCaller(spec.tool_timeout, defaultdict(float), defaultdict(lambda: [0.0, 0.0]))
    tools = {tool.__name__: tool for tool in spec.tools}
    for index, reply in enumerate(replies):
        if conversation.done:
            raise ValueError(f"The demonstration has {len(replies)} replies, but the conversation ended after {index}.")
        prompt_ids = conversation.prompt_ids()
        ids = _reply_ids(spec, messages, reply, prompt_ids)
        calls = conversation.add_turn(prompt_ids, ids, [0.0] * len(ids))
        if _normalized(calls) != _normalized(reply.get("tool_calls")):
            raise ValueError(
                f"TRL's response parser read the tool calls {calls!r} back from the rendered reply {reply!r}: the "
                "chat template and the tokenizer's response parser disagree (see `ensure_tool_parser`)."
            )
        if calls:
            conversation.add_tool_results(*_run(caller.run(calls, tools)))
    if not conversation.done:
        raise ValueError("The demonstration ends with a tool call: its last reply must answer without one.")
    sequences, _ = conversation.training_sequences(_FORK_THRESHOLD_TOKENS)
    if len(sequences) != 1:
        raise ValueError(f"The demonstration became {len(sequences)} training rows; re-tokenization drifted.")
    return DemonstrationRow(
        list(sequences[0].input_ids),
        list(sequences[0].completion_mask),
        conversation.tool_calls,
        conversation.tool_failures,
    )


def _reply_ids(spec: ConversationSpec, messages: list[dict[str, Any]], reply: dict[str, Any], prompt_ids: list[int]):
    """The tokens the policy would write for `reply`: the template's rendering with it, past `prompt_ids`, through
    the first end-of-turn token (what follows it is the next turn's context)."""
    tokenizer, options = spec.tokenizer, spec.options
    full = list(
        tokenizer.apply_chat_template(
            [*messages, reply],
            tools=list(spec.tools) or None,
            chat_template=options.chat_template,
            return_dict=False,
        )
    )
    if full[: len(prompt_ids)] != list(prompt_ids):
        raise ValueError(
            "The chat template renders the conversation with the assistant's reply differently from the "
            "conversation's generation prompt (it is not prefix-preserving), so the reply's tokens are undefined."
        )
    ids = full[len(prompt_ids) :]
    eos = tokenizer.eos_token_id
    return ids[: ids.index(eos) + 1] if eos in ids else ids


def _run(coroutine: Any) -> Any:
    """Run `coroutine` on a fresh event loop in a helper thread (a notebook's loop may already be running)."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sft-tools") as pool:
        return pool.submit(asyncio.run, coroutine).result()


def _normalized(calls: Any) -> list[tuple[str, Any]]:
    return [
        (call.get("function", call).get("name"), call.get("function", call).get("arguments")) for call in calls or []
    ]


def collate(rows: Sequence[DemonstrationRow], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded `input_ids` and `attention_mask`, and `labels` (-100 wherever the mask is 0 or padding), all
    `(batch, longest row)`: what a Hugging Face causal LM's `forward(labels=...)` takes."""
    length = max(len(row.input_ids) for row in rows)
    input_ids = torch.full((len(rows), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
    labels = torch.full((len(rows), length), -100, dtype=torch.long)
    for i, row in enumerate(rows):
        ids = torch.tensor(row.input_ids, dtype=torch.long)
        mask = torch.tensor(row.completion_mask, dtype=torch.bool)
        input_ids[i, : len(ids)] = ids
        attention_mask[i, : len(ids)] = 1
        labels[i, : len(ids)] = torch.where(mask, ids, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
