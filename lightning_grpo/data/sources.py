"""Prompt datasets: the builtin tasks (`tasks.py`: the synthetic arithmetic, calculator and number-guessing tasks,
reasoning-gym's `"reasoning_gym:<task>"`), local `.jsonl` / `.parquet` files, `datasets.Dataset`s and Hugging Face Hub
datasets, the last three optionally mapped by a preset (`dataset_format`: GSM8K, MATH, prompt + answer; see
`lightning_grpo.data.formats`).

Every dataset has a `prompt` column, chat messages or a string, plus whatever columns the reward functions read (the
builtin `accuracy` reward reads `answer`; see `columns.py`). How a prompt becomes token ids (the chat template, or a
string as raw text) is `lightning_grpo.rollout.chat.render_prompt`'s business.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from datasets import Dataset

from .tasks import builtin_task


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
        source: a builtin task of `lightning_grpo.data.tasks`: `"arithmetic"`, `"calculator"` or `"number_guess"`
            (`size` problems, default 600), `"reasoning_gym:<task>"` (`size` entries of that generator, default its
            own 500); a path to a `.jsonl`/`.json` or `.parquet` file, a `datasets.Dataset`, or a Hub dataset name
            (needs network access).
        size: number of rows to keep (the first `size`); for a generator, how many to generate.
        seed: seeds the generators.
        split: the split of a Hub dataset.
        dataset_format: a preset mapping a file's, `Dataset`'s or Hub dataset's columns to `prompt` and `answer`
            (`"gsm8k"`, `"math"`, `"prompt_answer"`; see `lightning_grpo.data.formats`); None uses them as they are.
        dataset_options: the preset's options, or the builtin task's (`BuiltinTask.option_problems` checks them).

    Raises:
        FileNotFoundError: a path that does not exist.
        ValueError: an empty dataset, a file type that is not supported, an unknown reasoning-gym task or options,
            or rows the preset cannot extract an answer from.
    """
    if (task := builtin_task(source)) is not None:
        return task.load(source, size, seed, dict(dataset_options or {}))
    if isinstance(source, Dataset):
        dataset = source
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


def check_source(source: str | Dataset | None) -> None:
    """Raise `FileNotFoundError` for a local path that does not exist (cheap; nothing is loaded)."""
    if isinstance(source, str) and builtin_task(source) is None and _looks_like_path(source):
        path = Path(source).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"The prompt dataset file `{path}` does not exist (dataset={source!r}).")


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
