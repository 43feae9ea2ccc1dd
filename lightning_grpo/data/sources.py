"""Prompt datasets: the builtin synthetic arithmetic, calculator and number-guessing tasks, reasoning-gym's tasks
(`"reasoning_gym:<task>"`), local `.jsonl` / `.parquet` files, `datasets.Dataset`s and Hugging Face Hub datasets, the last three optionally mapped by a
preset (`dataset_format`: GSM8K, MATH, prompt + answer; see `lightning_grpo.data.formats`).

Every dataset has a `prompt` column, chat messages or a string, plus whatever columns the reward functions read (the
builtin `accuracy` reward reads `answer`). How a prompt becomes token ids (the chat template, or a string as raw
text) is `lightning_grpo.rollout.chat.render_prompt`'s business.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from datasets import Dataset

BUILTIN_DATASETS = ("arithmetic", "calculator", "number_guess")
ANSWER_INSTRUCTION = "Put the final answer in \\boxed{}."
TEMPLATE_FIELD = "{question}"  # where `arithmetic_dataset(template=...)` puts the question


def arithmetic_dataset(size: int = 600, seed: int = 0, template: str | None = None) -> Dataset:
    """Synthetic arithmetic: 2-digit a+b, 1-digit a*b and 2-digit minus 1-digit, in equal shares.

    Columns: `prompt` (one user message: "What is 23+19? Put the final answer in \\boxed{}."), `answer` (the
    result as a string) and `task` (`add`, `mul` or `sub`). The same `(size, seed)` always gives the same rows.

    Args:
        size: problems to generate.
        seed: seeds the generator.
        template: raw text with `{question}` where the question goes ("What is 23+19?"): each `prompt` is then that
            string instead of a user message, for a base model (`GRPODataModule(dataset="arithmetic",
            dataset_options={"template": ...})`). The template says how to answer; no `\\boxed{}` instruction is added.

    Raises:
        ValueError: `size` < 1, or a template without `{question}`.
    """
    if size < 1:
        raise ValueError(f"`arithmetic_dataset(size={size})` needs at least one problem.")
    if problems := arithmetic_option_problems({} if template is None else {"template": template}):
        raise ValueError(f"`arithmetic_dataset(...)`: {'; '.join(problems)}.")
    rng = np.random.default_rng(seed)
    rows: dict[str, list[Any]] = {"prompt": [], "answer": [], "task": []}
    for i in range(size):
        task = ("add", "mul", "sub")[i % 3]
        if task == "add":
            a, b = rng.integers(10, 100, size=2)
            question, answer = f"{a}+{b}", a + b
        elif task == "mul":
            a, b = rng.integers(2, 10, size=2)
            question, answer = f"{a}*{b}", a * b
        else:
            a, b = rng.integers(10, 100), rng.integers(1, 10)
            question, answer = f"{a}-{b}", a - b
        if template is None:
            rows["prompt"].append([{"role": "user", "content": f"What is {question}? {ANSWER_INSTRUCTION}"}])
        else:  # str.replace, not str.format: a template may hold other braces (`\\boxed{}`)
            rows["prompt"].append(template.replace(TEMPLATE_FIELD, f"What is {question}?"))
        rows["answer"].append(str(int(answer)))
        rows["task"].append(task)
    return Dataset.from_dict(rows)


def arithmetic_option_problems(options: dict[str, Any]) -> list[str]:
    """What is wrong with `dataset_options` for the builtin arithmetic task (its one option is `template`)."""
    if unknown := sorted(set(options) - {"template"}):
        return [f"dataset_options keys {unknown} are not options of dataset='arithmetic' (its one option: 'template')"]
    template = options.get("template")
    if template is not None and (not isinstance(template, str) or TEMPLATE_FIELD not in template):
        return [f"dataset_options['template']={template!r} (a string with {TEMPLATE_FIELD} where the question goes)"]
    return []


def load_prompts(
    source: str | Dataset,
    *,
    size: int | None = None,
    seed: int = 0,
    split: str = "train",
    dataset_format: str | None = None,
    dataset_options: dict[str, Any] | None = None,
) -> Dataset:
    """Load a prompt dataset from a builtin name, a reasoning-gym task, a local file, a `datasets.Dataset` or a Hub
    dataset name.

    Args:
        source: `"arithmetic"`, `"calculator"` or `"number_guess"` (builtin; `size` problems, default 600; see
            `lightning_grpo.data.calculator` and `lightning_grpo.environments.number_guess`, whose `high` is a
            `dataset_options` key), `"reasoning_gym:<task>"` (`size` entries of
            that generator, default its own 500; see `lightning_grpo.data.reasoning_gym`), a path to a
            `.jsonl`/`.json` or `.parquet` file, a `datasets.Dataset`, or a Hub dataset name (needs network access).
        size: number of rows to keep (the first `size`); for a generator, how many to generate.
        seed: seeds the generators.
        split: the split of a Hub dataset.
        dataset_format: a preset mapping a file's, `Dataset`'s or Hub dataset's columns to `prompt` and `answer`
            (`"gsm8k"`, `"math"`, `"prompt_answer"`; see `lightning_grpo.data.formats`); None uses them as they are.
        dataset_options: the preset's options, or the reasoning-gym task's generator options.

    Raises:
        FileNotFoundError: a path that does not exist.
        ValueError: an empty dataset, a file type that is not supported, an unknown reasoning-gym task or options,
            or rows the preset cannot extract an answer from.
    """
    from . import reasoning_gym

    if reasoning_gym.is_reasoning_gym(source):
        return reasoning_gym.reasoning_gym_dataset(source, size=size, seed=seed, options=dataset_options)
    if isinstance(source, Dataset):
        dataset = source
    elif source == "calculator":
        from .calculator import calculator_dataset

        return calculator_dataset(size or 600, seed)
    elif source == "number_guess":
        from ..environments.number_guess import number_guess_dataset

        return number_guess_dataset(size or 600, seed, **(dataset_options or {}))
    elif source in BUILTIN_DATASETS:
        return arithmetic_dataset(size or 600, seed, **(dataset_options or {}))
    elif _looks_like_path(source):
        dataset = _load_file(Path(source))
    else:
        from datasets import load_dataset

        dataset = load_dataset(source, split=split)
    if size is not None:
        dataset = dataset.select(range(min(size, len(dataset))))
    if len(dataset) == 0:
        raise ValueError(f"The prompt dataset {source!r} has no rows.")
    if dataset_format is not None:
        from .formats import apply_format

        dataset = apply_format(dataset, dataset_format, dataset_options, source=f"The prompt dataset {source!r}")
    return dataset


def is_generated(source: Any) -> bool:
    """Whether a `dataset` value names a generator (the builtin arithmetic, a reasoning-gym task), not rows."""
    from .reasoning_gym import is_reasoning_gym

    return isinstance(source, str) and (source in BUILTIN_DATASETS or is_reasoning_gym(source))


def check_source(source: str | Dataset | None) -> None:
    """Raise `FileNotFoundError` for a local path that does not exist (cheap; nothing is loaded)."""
    if isinstance(source, str) and not is_generated(source) and _looks_like_path(source):
        path = Path(source).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"The prompt dataset file `{path}` does not exist (dataset={source!r}).")


def check_columns(dataset: Dataset, required: set[str], *, source: str = "the prompt dataset") -> None:
    """Raise `ValueError` naming the missing columns (and the ones present) when `dataset` lacks any of `required`."""
    missing = sorted(required - set(dataset.column_names))
    if missing:
        raise ValueError(
            f"{source} has no column(s) {missing}; it has {dataset.column_names}. Every dataset needs a `prompt` "
            "column (chat messages or a string) plus the columns your reward functions read."
        )


#: What the rollout loop passes every reward function besides the dataset's columns.
REWARD_ARGUMENTS = frozenset({"completions", "prompts", "completion_ids"})


def reward_columns(func: Callable) -> set[str]:
    """The dataset columns `func` cannot be called without: its named parameters without a default, other than
    `completions`, `prompts` and `completion_ids` (empty when its signature cannot be read)."""
    try:
        # a partial's own signature (its bound keywords have defaults), even when update_wrapper points past it
        parameters = inspect.signature(func, follow_wrapped=not isinstance(func, functools.partial)).parameters.values()
    except (TypeError, ValueError):
        return set()
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    required = {p.name for p in parameters if p.kind in named and p.default is inspect.Parameter.empty}
    return required - REWARD_ARGUMENTS


def check_reward_columns(dataset: Dataset, reward_funcs: Sequence[Callable], *, source: str) -> None:
    """Raise `ValueError` naming a reward function and the dataset columns it needs that `dataset` lacks."""
    from .._trl import get_callable_name

    problems = []
    for func in reward_funcs:
        missing = sorted(reward_columns(func) - set(dataset.column_names))
        if missing:
            problems.append(f"reward {get_callable_name(func)!r} needs column(s) {missing}")
    if problems:
        raise ValueError(
            f"{source}: {'; '.join(problems)}, but the dataset has {dataset.column_names}. Add the column(s), or use "
            "reward functions that read the columns it has."
        )


def as_messages(prompt: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A prompt as chat messages: a plain string becomes one user message (see `render_prompt` for raw text)."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


def _looks_like_path(source: str) -> bool:
    return (
        source.endswith((".jsonl", ".json", ".parquet"))
        or Path(source).exists()
        or "/" in source
        and (source.startswith((".", "/", "~")))
    )


def _load_file(path: Path) -> Dataset:
    path = path.expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"The prompt dataset file `{path}` does not exist.")
    readers = {".jsonl": Dataset.from_json, ".json": Dataset.from_json, ".parquet": Dataset.from_parquet}
    if path.suffix not in readers:
        raise ValueError(f"`{path}` is not a .jsonl, .json or .parquet file; convert it or pass a `datasets.Dataset`.")
    with _quiet_datasets():
        return readers[path.suffix](str(path))


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    """Without `datasets`' "Generating train split" bar: a local file of prompts loads in moments."""
    from datasets.utils import logging as datasets_logging

    shown = datasets_logging.is_progress_bar_enabled()
    datasets_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            datasets_logging.enable_progress_bar()
