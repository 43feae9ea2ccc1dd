"""One rollout's conversation with the policy, turn by turn: the multi-turn loop of TRL's `_generate_one`, as a state
machine that the rollout loop (one conversation per asyncio task) and validation (a batch of conversations per
`generate` call) both drive, so held-out metrics measure what training optimises.

Each turn's prompt is the whole conversation so far rendered with the chat template (re-tokenized every turn, as
TRL does, so drift is caught); the policy's reply is parsed for tool calls with TRL's response parser; the tool
results go back as `tool` messages. The conversation ends on a reply without tool calls, or, when the policy asked for
a tool after `max_tool_calling_iterations` tool rounds, right there (`loop_exhausted`). Its turns become training rows
with TRL's `_chain_to_sequences`: the policy's tokens are trained (mask 1), prompt, tool results and environment
observations are context (mask 0).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .._trl import TrainingSequence, TurnRecord, _chain_to_sequences, parse_response
from .chat import PromptFormat, as_messages, render_prompt, uses_raw_text


@dataclass(frozen=True)
class ConversationOptions:
    """How conversations are rendered and bounded; the same for the rollout loop and for validation.

    Attributes:
        tokenizer: the policy's tokenizer (its chat template renders each turn; its response parser reads calls).
        prompt_format: `"auto"`, `"chat"` or `"text"` (see `lightning_grpo.rollout.chat.uses_raw_text`).
        chat_template: a template to render with instead of the tokenizer's (see `conversation_chat_template`).
        chat_template_kwargs: extra template variables.
        max_tool_calling_iterations: tool rounds before a conversation that keeps calling tools is cut off
            (None: no limit, TRL's default).
    """

    tokenizer: Any
    prompt_format: PromptFormat = "auto"
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    max_tool_calling_iterations: int | None = None


class Conversation:
    """One conversation: call `prompt_ids()`, generate from them, `add_turn(...)`; run the tool calls it returns and
    `add_tool_results(...)`; repeat until `done`.

    Args:
        prompt: chat messages, or a string (raw text or one user message, per `options.prompt_format`).
        options: rendering and bounds.
        tools: the tools whose schemas the policy sees (empty: a single plain turn, decoded as text).

    Attributes:
        completion: the policy's messages and the tool results (a string for a raw-text prompt, TRL's standard format).
        completion_ids: the policy's tokens over all turns (what reward functions get as `completion_ids`).
        turns: one `TurnRecord` per generation call.
        tool_calls, tool_failures: calls made and calls that failed.
        loop_exhausted: it ended because the policy kept calling tools past `max_tool_calling_iterations`.
    """

    def __init__(
        self, prompt: str | list[dict[str, Any]], options: ConversationOptions, tools: Sequence[Callable] = ()
    ):
        self.options = options
        self.raw_text = uses_raw_text(prompt, options.tokenizer, options.prompt_format)
        if self.raw_text and tools:
            raise ValueError("Tool calling needs chat prompts; a raw-text prompt cannot carry tool calls.")
        self.prompt = prompt
        self.tools = list(tools)
        self.messages = None if self.raw_text else as_messages(prompt)
        self.completion: list[dict[str, Any]] | str = "" if self.raw_text else []
        self.completion_ids: list[int] = []
        self.turns: list[TurnRecord] = []
        self.tool_calls = 0
        self.tool_failures = 0
        self.loop_exhausted = False
        self.done = False
        self._iterations = 0

    def prompt_ids(self) -> list[int]:
        """What the policy continues from this turn: the whole conversation so far, rendered."""
        options = self.options
        return render_prompt(
            options.tokenizer,
            self.prompt if self.messages is None else self.messages,  # raw text has no messages
            prompt_format=options.prompt_format,
            tools=self.tools,
            chat_template=options.chat_template,
            chat_template_kwargs=options.chat_template_kwargs,
        )

    def add_turn(self, prompt_ids: list[int], ids: list[int], logprobs: list[float]) -> list[dict[str, Any]] | None:
        """Record the policy's reply to `prompt_ids`; returns the tool calls to run next, or None when it is done."""
        tokenizer = self.options.tokenizer
        self.turns.append(TurnRecord(list(prompt_ids), list(ids), list(logprobs)))
        self.completion_ids.extend(ids)
        if self.raw_text:
            self.completion = tokenizer.decode(ids, skip_special_tokens=True)
            self.done = True
            return None
        if self.tools:
            message = parse_response(tokenizer, list(ids), prefix=list(prompt_ids), tools=self.tools)
        else:  # no tools: plain text, no response parser needed
            message = {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
        completion, messages = self._chat()
        completion.append(message)
        messages.append(message)
        calls = message.get("tool_calls")
        if not calls:
            self.done = True
            return None
        limit = self.options.max_tool_calling_iterations
        if limit is not None and self._iterations >= limit:
            # The policy asked for another tool and was refused: trained as if it had finished, hence the metric.
            self.loop_exhausted = self.done = True
            return None
        return calls

    def add_tool_results(self, messages: list[dict[str, str]], calls: int, failures: int) -> None:
        """The results of the calls `add_turn` returned, as `tool` messages (context for the next turn)."""
        completion, history = self._chat()
        completion.extend(messages)
        history.extend(messages)
        self.tool_calls += calls
        self.tool_failures += failures
        self._iterations += 1

    def _chat(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The completion's messages and the whole conversation's; a raw-text one has neither (one turn, then done)."""
        if isinstance(self.completion, str) or self.messages is None:
            raise RuntimeError("A raw-text conversation ends after its one turn: it has no messages to add to.")
        return self.completion, self.messages

    def training_sequences(self, fork_threshold_tokens: int) -> tuple[list[TrainingSequence], dict[str, float]]:
        """The conversation's training rows (one, or more where re-tokenization drifted) and TRL's drift tally."""
        return _chain_to_sequences(self.turns, uuid.uuid4().hex, fork_threshold_tokens)
