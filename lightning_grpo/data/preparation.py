"""What `GRPODataModule` loads and checks before anything starts: the prompts, the held-out prompts, the tokenizer
and the conversations (tools, environments, prompt format).

Every check here runs on every rank at `setup` (and from `lightning-grpo` before the trainer starts), so a dataset
without a column a reward needs, or a tokenizer that cannot render the prompts, fails with one line naming it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from datasets import Dataset
from lightning.pytorch.utilities import rank_zero_warn

from ..options import ChatOptions, DataOptions, PromptFormat
from .columns import check_columns, check_columns_for_rewards
from .reasoning_gym import is_reasoning_gym
from .sources import load_prompts
from .tasks import BUILTIN_DATASETS
from .tooling import ConversationSpec

#: Generated held-out prompts (arithmetic, calculator, reasoning-gym) come from another seed than the training ones:
#: this much higher, or `dataset_size` higher when that is more (reasoning-gym seeds entry `i` with `seed + i`).
VAL_SEED_OFFSET = 10_000


@dataclass
class PromptData:
    """The loaded and checked inputs of one run."""

    prompts: Dataset
    val_prompts: Dataset | None
    tokenizer: Any
    conversation: ConversationSpec


def prepare_prompts(
    data: DataOptions,
    chat: ChatOptions,
    *,
    dataset: Any,
    val_dataset: Any,
    reward_funcs: Sequence[Callable],
    tokenizer_name: str | None,
    tools: Any,
    environment_factory: Any,
) -> PromptData:
    """Load the prompts (and held-out prompts), check their columns, load the tokenizer and check that it renders
    them in the configured prompt format.

    Raises:
        ValueError: a missing column (named, with the dataset), no tokenizer name or one that does not load, a prompt
            the tokenizer cannot render.
    """
    prompts = load_prompts(dataset, size=data.dataset_size, seed=data.dataset_seed, **_format(data))
    _check(prompts, reward_funcs, f"`GRPODataModule(dataset={dataset!r})`")
    val_prompts = _load_val_prompts(data, dataset, val_dataset, reward_funcs)
    tokenizer = load_named_tokenizer(tokenizer_name)
    conversation = ConversationSpec(
        tokenizer=tokenizer,
        prompt_format=chat.prompt_format,
        tools=tools,
        environment_factory=environment_factory,
        max_tool_calling_iterations=chat.max_tool_calling_iterations,
        tool_timeout=chat.tool_timeout,
    )
    _check_rendering(conversation, chat.prompt_format, {"dataset": prompts, "val_dataset": val_prompts})
    return PromptData(prompts, val_prompts, tokenizer, conversation)


def longest_prompt(conversation: ConversationSpec | None, prompts: Dataset | None) -> int:
    """The longest first turn of `prompts` as `conversation` renders it, in tokens.

    Raises:
        RuntimeError: before the prompts are loaded (`GRPODataModule.setup` or `check_data` loads them).
    """
    if conversation is None or prompts is None:
        raise RuntimeError("GRPODataModule measures its prompts once they are loaded (`setup` or `check_data`).")
    return max(len(conversation.render(row)) for row in prompts)


def load_named_tokenizer(name: str | None) -> Any:
    """`load_tokenizer(name)`, with an error that says which name failed and how to give one.

    Raises:
        ValueError: no name, or a name that is neither a folder nor a reachable Hub id.
    """
    from ..models.loading import load_tokenizer

    if name is None:
        raise ValueError(
            "GRPODataModule needs a tokenizer: pass `model=` (a name or path) or `tokenizer=`, or give the "
            "GRPOModule its policy by name."
        )
    try:
        return load_tokenizer(name)
    except OSError as error:  # transformers' error for a name that is neither a folder nor a reachable Hub id
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"`GRPODataModule` could not load the tokenizer {name!r}: {first_line}") from error


def _check(prompts: Dataset, reward_funcs: Sequence[Callable], source: str) -> None:
    check_columns(prompts, {"prompt"}, source=source)
    check_columns_for_rewards(prompts, reward_funcs, source=source)


def _load_val_prompts(
    data: DataOptions, dataset: Any, val_dataset: Any, reward_funcs: Sequence[Callable]
) -> Dataset | None:
    val_seed = data.dataset_seed + max(VAL_SEED_OFFSET, data.dataset_size or 0)
    if val_dataset is None and isinstance(dataset, str) and dataset in BUILTIN_DATASETS:
        return load_prompts(dataset, size=data.val_size, seed=val_seed, dataset_options=data.dataset_options)
    if val_dataset is None and is_reasoning_gym(dataset):
        val_dataset = dataset  # the same task and options, another seed
    if val_dataset is None:
        return None
    prompts = load_prompts(val_dataset, size=data.val_size, seed=val_seed, **_format(data))
    _check(prompts, reward_funcs, f"`GRPODataModule(val_dataset={val_dataset!r})`")
    return prompts


def _format(data: DataOptions) -> dict[str, Any]:
    return {"dataset_format": data.dataset_format, "dataset_options": data.dataset_options}


def _check_rendering(
    conversation: ConversationSpec, prompt_format: PromptFormat, sources: dict[str, Dataset | None]
) -> None:
    """The first prompt of each source renders in `prompt_format` with this tokenizer (and its tools)."""
    from ..rollout.chat import ensure_tool_parser, prompt_problems

    tokenizer = conversation.tokenizer
    problems = [
        f"{what}: {problem}"
        for what, rows in sources.items()
        if rows is not None and "prompt" in rows.column_names
        for problem in prompt_problems(rows[0]["prompt"], tokenizer, prompt_format, tools=conversation.uses_tools)
    ]
    if problems:
        raise ValueError(f"GRPODataModule cannot render its prompts: {'; '.join(problems)}.")
    if conversation.uses_tools and (note := ensure_tool_parser(tokenizer)):
        rank_zero_warn(note)
