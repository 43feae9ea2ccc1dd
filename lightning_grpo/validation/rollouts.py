"""Held-out validation: the policy being trained holds the same conversations as the training rollouts.

`validation_rollouts` runs `num_generations` conversations per held-out prompt, all of a batch's turns in one
left-padded `generate` call (greedy, or sampled at a temperature), with the run's tools and environments
(`lightning_grpo.rollout.conversation.Conversation`, the rollout loop's own state machine; tool and environment
faults are contained as in training). Under a sharded policy, whose forward is a collective, every rank runs the
same number of turns (the most any rank needs) and every turn runs all `max_tokens` forwards.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections import defaultdict
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import StoppingCriteria

from ..data.tooling import ConversationSpec
from ..rollout.conversation import Conversation
from ..rollout.environments import prompt_of, tool_methods, with_observation
from ..rollout.stop_strings import StopStrings
from ..rollout.tool_calls import ToolCaller
from ..training.compilation import eager_layers


@dataclass(frozen=True)
class Sampling:
    """How validation generates: greedy at `temperature=0`, else sampled with top-p/top-k.

    Attributes:
        max_tokens: tokens per turn.
        temperature: 0 for greedy.
        top_p: nucleus mass kept when sampling.
        top_k: tokens kept by rank when sampling (0: all).
        attention: the attention implementation for a padded batch (the policy's loaded one, not tree attention).
        fixed_length: run all `max_tokens` forwards of every turn, and the same number of turns on every rank
            (`sync_active`); needed where the policy's forward is a collective (a sharded policy).
        stop: stop strings: a turn ends at the first token whose text completes one, as in training.
    """

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    attention: str = "sdpa"
    fixed_length: bool = False
    stop: tuple[str, ...] = ()


@dataclass
class ValidationRollouts:
    """The conversations of one validation batch, `num_generations` per row, row-major, and what scored them.

    Attributes:
        rows: each held-out row, repeated `num_generations` times.
        conversations: one per entry of `rows`.
        environment_ok: per conversation, False when its environment's `reset` failed (scored NaN in every column).
        environment_rewards: `{column name: rewards}` of the environments with a `get_reward` (None: not scored).
        counters, rates: tool and environment metrics (TRL's names).
    """

    rows: list[dict[str, Any]]
    conversations: list[Conversation] = field(default_factory=list)
    environment_ok: list[bool] = field(default_factory=list)
    environment_rewards: dict[str, list[float | None]] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    rates: dict[str, list[float]] = field(default_factory=lambda: defaultdict(lambda: [0.0, 0.0]))

    @property
    def completions(self) -> list[Any]:
        return [conversation.completion for conversation in self.conversations]


@torch.no_grad()
def validation_rollouts(
    policy: torch.nn.Module,
    rows: list[dict[str, Any]],
    spec: ConversationSpec,
    sampling: Sampling,
    *,
    num_generations: int = 1,
    eos_token_ids: list[int],
    sync_active: Callable[[int], int] | None = None,
) -> ValidationRollouts:
    """Run `num_generations` conversations per row with `policy`; see the module docstring.

    Args:
        policy: the policy (switched to `sampling.attention` for the padded batches and back).
        rows: held-out dataset rows, each with a `prompt`.
        spec: the run's prompt format, tools and environments (the contract's `conversation`).
        sampling: generation options.
        num_generations: conversations per row.
        eos_token_ids: ids that end a turn.
        sync_active: with `fixed_length`, the most conversations still running on any rank, given this rank's (an
            all-reduce); a rank with none left keeps generating a dummy turn while another rank has some.
    """
    batch = ValidationRollouts(rows=[row for row in rows for _ in range(num_generations)])
    environments = spec.environments
    names = [environments.name_of(row) if environments else None for row in batch.rows]
    taken = [environments.acquire(name) if environments else None for name in names]
    guards = dict(timeout=spec.tool_timeout, counters=batch.counters, rates=batch.rates)
    previous = policy.config._attn_implementation
    policy.set_attn_implementation(sampling.attention)
    try:
        resets = _run(_gather(_reset(spec, row, env, guards) for row, env in zip(batch.rows, taken, strict=True)))
        for row, environment, (observation, ok) in zip(batch.rows, taken, resets, strict=True):
            prompt = with_observation(prompt_of(row, environment), observation)
            batch.conversations.append(Conversation(prompt, spec.options, tools=spec.tools_for(row)))
            batch.environment_ok.append(ok)
        tools = [{tool.__name__: tool for tool in [*spec.tools, *tool_methods(env)]} for env in taken]
        turns = _Turns(policy, sampling, eos_token_ids, spec.tokenizer, sync_active)
        turns.run(batch.conversations, tools, ToolCaller(spec.tool_timeout, batch.counters, batch.rates))
        if environments is not None:
            scored = [env if ok else None for env, ok in zip(taken, batch.environment_ok, strict=True)]
            results = _run(_gather(_reward(spec, env, guards) for env in scored))
            batch.environment_rewards = dict(
                zip(environments.reward_names, environments.rewards_per_type(results), strict=True)
            )
    finally:
        policy.set_attn_implementation(previous)
        for name, environment in zip(names, taken, strict=True):
            if environments is not None and environment is not None:
                environments.release(name, environment)
    return batch


class _Turns:
    """Turn after turn: one batched `generate` for every conversation still running, then their tool calls."""

    def __init__(self, policy, sampling: Sampling, eos_token_ids, tokenizer, sync_active) -> None:
        self.policy, self.sampling, self.eos, self.sync_active = policy, sampling, eos_token_ids, sync_active
        self.tokenizer = tokenizer
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def run(self, conversations: list[Conversation], tools: list[dict[str, Callable]], caller: ToolCaller) -> None:
        while self._keep_going(active := [i for i, c in enumerate(conversations) if not c.done]):
            prompts = [conversations[i].prompt_ids() for i in active]
            # a rank with nothing left still generates (one pad token) while another rank has conversations
            outputs = generate(
                self.policy,
                prompts or [[self.pad]],
                self.sampling,
                eos_token_ids=self.eos,
                pad_token_id=self.pad,
                tokenizer=self.tokenizer,
            )
            pending = []
            for i, prompt_ids, ids in zip(active, prompts, outputs, strict=False):
                calls = conversations[i].add_turn(prompt_ids, ids, [0.0] * len(ids))  # logprobs are not needed here
                if calls:
                    pending.append((i, calls))
            results = _run(_gather(caller.run(calls, tools[i]) for i, calls in pending))
            for (i, _), result in zip(pending, results, strict=True):
                conversations[i].add_tool_results(*result)

    def _keep_going(self, active: list[int]) -> bool:
        if self.sync_active is not None:
            return self.sync_active(len(active)) > 0
        return bool(active)


def generate(
    policy: torch.nn.Module,
    prompts: list[list[int]],
    sampling: Sampling,
    *,
    eos_token_ids: list[int],
    pad_token_id: int,
    tokenizer: Any = None,
) -> list[list[int]]:
    """One turn for each prompt from a left-padded batched `generate`: its ids, up to and including the first EOS
    or the token that completed one of `sampling.stop` (decoded with `tokenizer`)."""
    device = next(policy.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    stops = StopStrings(sampling.stop, tokenizer) if sampling.stop else None
    sample = sampling.temperature > 0
    options = dict(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k) if sample else {}
    with eager_layers():  # compiled layers (`torch_compile`) are for training; generate's shapes would recompile
        out = policy.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=sampling.max_tokens,
            do_sample=sample,
            pad_token_id=pad_token_id,
            eos_token_id=None if sampling.fixed_length else eos_token_ids,
            # not transformers' `stop_strings`, which also match text that began in the prompt
            stopping_criteria=[_StopStringCriteria(stops, width)] if stops and not sampling.fixed_length else None,
            **options,
        )
    turns = [_cut_at(row.tolist(), eos_token_ids) for row in out[:, width:]]
    return [_cut_at_stop(ids, stops) for ids in turns] if stops else turns


def reward_table(
    batch: ValidationRollouts, function_rewards: Mapping[str, Sequence[float | None]], names: list[str]
) -> np.ndarray:
    """`(len(names), len(batch.rows))` rewards in the contract's column order, NaN where not scored; every column is
    NaN for a conversation whose environment failed to reset (as in training)."""
    values = {**function_rewards, **batch.environment_rewards}
    missing = [None] * len(batch.rows)
    columns = np.array(
        [[np.nan if r is None else float(r) for r in values.get(name, missing)] for name in names], dtype=np.float64
    ).reshape(len(names), len(batch.rows))
    columns[:, ~np.asarray(batch.environment_ok, dtype=bool)] = np.nan
    return columns


async def _reset(spec: ConversationSpec, row: dict[str, Any], environment: Any, guards: dict) -> tuple[Any, bool]:
    environments = spec.environments
    if environments is None or environment is None:
        return None, True
    return await environments.reset(environment, row, **guards)


async def _reward(spec: ConversationSpec, environment: Any, guards: dict) -> tuple[type, float | None] | None:
    environments = spec.environments
    if environments is None or environment is None:
        return None
    return await environments.reward(environment, **guards)


async def _gather(coroutines: Any) -> list[Any]:
    return list(await asyncio.gather(*coroutines))


def _run(coroutine: Coroutine) -> Any:
    """Run `coroutine` to completion on a fresh event loop in a helper thread (a notebook's loop may be running)."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grpo-validation") as pool:
        return pool.submit(asyncio.run, coroutine).result()


class _StopStringCriteria(StoppingCriteria):
    """Ends each row of a `generate` once its completion (the ids after `width`) holds a stop string."""

    def __init__(self, stops: StopStrings, width: int) -> None:
        self.stops, self.width = stops, width

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        found = [self.stops.found(row[self.width :].tolist()) is not None for row in input_ids]
        return torch.tensor(found, dtype=torch.bool, device=input_ids.device)


def _cut_at_stop(ids: list[int], stops: StopStrings) -> list[int]:
    """`ids` up to and including the token whose text completed a stop string (the embedded generator's rule)."""
    for end in range(1, len(ids) + 1):
        if stops.found(ids[:end]) is not None:
            return ids[:end]
    return ids


def _cut_at(ids: list[int], eos_token_ids: list[int]) -> list[int]:
    """`ids` up to and including the first EOS."""
    for index, token in enumerate(ids):
        if token in eos_token_ids:
            return ids[: index + 1]
    return ids
