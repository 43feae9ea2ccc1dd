"""reasoning-gym's procedural tasks as a prompt source, and the scorer its reward calls.

`GRPODataModule(dataset="reasoning_gym:<task>", dataset_size=N, dataset_seed=s, dataset_options={...})` builds its rows
from `reasoning_gym.create_dataset(task, size=N, seed=s, **dataset_options)` (`N` defaults to the task's own size,
500). Each row holds:

- `prompt`: chat messages: reasoning-gym's `"default"` system prompt (think step by step, then the answer inside
  `<answer>...</answer>`, the format its `extract_answer` reads), then the entry's `question` as the user message.
  `dataset_options={"system_prompt": ...}` takes another of `reasoning_gym.utils.SYSTEM_PROMPTS`' names, any text,
  or `""` for none; every other key is an option of the task's config (e.g. countdown's `min_numbers`). Tasks mix
  with `reasoning_gym:composite` and `{"datasets": [{"name": "countdown", "weight": 2, "config": {...}}, ...]}`
  (`weight` defaults to 1, `config` to the task's defaults).
- `question`, `answer` (None for tasks with many right answers, which score by checking, e.g. `rush_hour`).
- `metadata`: the entry's metadata as JSON text, so pyarrow stores rows of any task in one column and the rollout
  child pickles them; tuples, sets, fractions and dicts with non-string keys are tagged so that decoding gives back
  exactly the entry's values (ARC's `score_answer` compares a grid of tuples, graph_color's reads a dict by int keys,
  gsm_symbolic keeps fractions).
- `gym_task` and `gym_options` (JSON): which generator and options made the row, so the scorer is rebuilt with the
  same config (some tasks score by it, e.g. `decimal_arithmetic`'s precision).

`lightning_grpo.rewards.reasoning_gym` scores a completion with the task's own `score_answer`, given the text inside
the completion's last `<answer>...</answer>` as reasoning-gym's `extract_answer` takes it (None when there is none).

This module imports no Lightning (the reward runs in the rollout child) and imports `datasets` only to build rows.
"""

from __future__ import annotations

import difflib
import functools
import json
from decimal import Decimal
from fractions import Fraction
from typing import Any

PREFIX = "reasoning_gym:"
SYSTEM_PROMPT_OPTION = "system_prompt"
DEFAULT_SYSTEM_PROMPT = "default"
_INSTALL_HINT = "reasoning-gym is not installed: `pip install reasoning-gym` (it is a dependency of lightning-grpo)."


def is_reasoning_gym(source: Any) -> bool:
    """Whether a `dataset` value names a reasoning-gym task (`"reasoning_gym:<task>"`)."""
    return isinstance(source, str) and source.startswith(PREFIX)


def task_name(source: str) -> str:
    """`"countdown"` for `"reasoning_gym:countdown"`."""
    return source[len(PREFIX) :].strip()


def option_problems(source: str, options: dict[str, Any] | None) -> list[str]:
    """What is wrong with `dataset="reasoning_gym:<task>"` and its `dataset_options`, without generating anything:
    an unknown task (with the names there are), an option the task's config does not have, a value it refuses."""
    import dataclasses

    registry = _registry()
    task = task_name(source)
    if task not in registry:
        close = difflib.get_close_matches(task, registry, n=3)
        hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
        return [f"dataset={source!r}: reasoning-gym has no task {task!r}; {hint}It has {sorted(registry)}"]
    options = dict(options or {})
    system_prompt = options.pop(SYSTEM_PROMPT_OPTION, DEFAULT_SYSTEM_PROMPT)
    problems = [] if isinstance(system_prompt, str) else [f"dataset_options['system_prompt']={system_prompt!r}"]
    config_cls = registry[task][1]
    fields = {field.name for field in dataclasses.fields(config_cls)}
    if reserved := sorted({"size", "seed"} & set(options)):
        problems.append(f"dataset_options sets {reserved}: use dataset_size and dataset_seed (val_size for held out)")
    if unknown := sorted(set(options) - fields):
        problems.append(
            f"dataset_options {unknown} are not options of reasoning-gym's {task!r} (it has {sorted(fields - {'size', 'seed'})})"
        )
    if task == "composite":
        names = [spec.get("name") for spec in options.get("datasets") or [] if isinstance(spec, dict)]
        problems += [
            f"dataset_options['datasets'] names {name!r}, not a reasoning-gym task"
            for name in names
            if name not in registry
        ]
    if not problems:
        try:
            config = config_cls(**_config_options(task, options))
            if hasattr(config, "validate"):
                config.validate()
        except (AssertionError, ValueError, TypeError) as error:
            problems.append(
                f"reasoning-gym's {task!r} refuses dataset_options={options!r}: {error or type(error).__name__}"
            )
    return problems


def reasoning_gym_dataset(source: str, *, size: int | None, seed: int, options: dict[str, Any] | None = None) -> Any:
    """The rows of `reasoning_gym.create_dataset(task, size=size, seed=seed, **options)` as a `datasets.Dataset`
    (columns in the module docstring); `size=None` takes the task's default size.

    Raises:
        ValueError: an unknown task or bad options (see `option_problems`).
    """
    from datasets import Dataset

    if problems := option_problems(source, options):
        raise ValueError(f"`GRPODataModule(dataset={source!r})`: {'; '.join(problems)}.")
    import reasoning_gym

    task = task_name(source)
    task_options = {key: value for key, value in (options or {}).items() if key != SYSTEM_PROMPT_OPTION}
    system = _system_prompt((options or {}).get(SYSTEM_PROMPT_OPTION, DEFAULT_SYSTEM_PROMPT))
    sized = {"size": size} if size is not None else {}
    entries = reasoning_gym.create_dataset(task, seed=seed, **sized, **_config_options(task, task_options))
    options_json = json.dumps(task_options, sort_keys=True)
    rows: dict[str, list[Any]] = {
        key: [] for key in ("prompt", "question", "answer", "metadata", "gym_task", "gym_options")
    }
    for entry in entries:
        question = entry["question"]
        prompt = [{"role": "user", "content": question}]
        rows["prompt"].append([{"role": "system", "content": system}, *prompt] if system else prompt)
        rows["question"].append(question)
        rows["answer"].append(None if entry["answer"] is None else str(entry["answer"]))
        rows["metadata"].append(encode_metadata(entry["metadata"]))
        rows["gym_task"].append(task)
        rows["gym_options"].append(options_json)
    return Dataset.from_dict(rows)


def score(
    answer_text: str | None, *, answer: str | None, metadata: str, task: str, task_options: str, question: str
) -> float:
    """The task's own `score_answer(answer_text, entry)` for the entry these columns describe (see the module)."""
    entry = {"question": question, "answer": answer, "metadata": decode_metadata(metadata)}
    return float(_scorer(task, task_options or "{}")(answer_text, entry))


def extract_answer(text: str) -> str | None:
    """reasoning-gym's own `extract_answer`: the stripped text of the last `<answer>...</answer>`, else None."""
    from reasoning_gym.utils import extract_answer as rg_extract_answer

    return rg_extract_answer(text)


def encode_metadata(metadata: dict[str, Any]) -> str:
    """`metadata` as JSON text; tuples become `{"__tuple__": [...]}`, sets `{"__set__": [...]}`, dicts with keys that
    are not strings `{"__items__": [[key, value], ...]}`, fractions `{"__fraction__": "1/2"}` and decimals
    `{"__decimal__": "0.5"}`; numpy values become Python ones. No pickle: decoding a dataset runs no code.

    Raises:
        TypeError: a value of another type (none of reasoning-gym 0.1.25's tasks makes one).
    """
    return json.dumps(_tagged(metadata), sort_keys=True)


def decode_metadata(text: str) -> dict[str, Any]:
    """The inverse of `encode_metadata`."""
    return json.loads(text, object_hook=_untag)


def _tagged(value: Any) -> Any:
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        return {key: _tagged(item) for key, item in value.items()}
    if isinstance(value, dict):  # JSON keys are strings: keep `{0: "red"}`'s int keys
        return {"__items__": [[_tagged(key), _tagged(item)] for key, item in value.items()]}
    if isinstance(value, tuple):
        return {"__tuple__": [_tagged(item) for item in value]}
    if isinstance(value, set | frozenset):
        return {"__set__": [_tagged(item) for item in sorted(value, key=repr)]}
    if isinstance(value, list):
        return [_tagged(item) for item in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, Fraction):  # gsm_symbolic's quantities
        return {"__fraction__": str(value)}
    if isinstance(value, Decimal):
        return {"__decimal__": str(value)}
    if hasattr(value, "tolist"):  # numpy scalars and arrays
        return _tagged(value.tolist())
    raise TypeError(f"reasoning-gym metadata value {value!r:.100} of type {type(value).__name__} is not serialisable")


def _untag(value: dict[str, Any]) -> Any:
    if value.keys() == {"__tuple__"}:
        return tuple(value["__tuple__"])
    if value.keys() == {"__set__"}:
        return {_hashable(item) for item in value["__set__"]}
    if value.keys() == {"__fraction__"}:
        return Fraction(value["__fraction__"])
    if value.keys() == {"__decimal__"}:
        return Decimal(value["__decimal__"])
    if value.keys() == {"__items__"}:
        return {_hashable(key): item for key, item in value["__items__"]}
    return value


def _hashable(value: Any) -> Any:
    return tuple(_hashable(item) for item in value) if isinstance(value, list) else value


def _system_prompt(name_or_text: str) -> str:
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return SYSTEM_PROMPTS.get(name_or_text, name_or_text)


@functools.lru_cache(maxsize=32)
def _scorer(task: str, task_options: str) -> Any:
    """One dataset per task and options in each process, built once: its `score_answer` (some read its config)."""
    import reasoning_gym

    options = _config_options(task, json.loads(task_options))
    return reasoning_gym.create_dataset(task, size=1, seed=0, **options).score_answer


def _config_options(task: str, options: dict[str, Any]) -> dict[str, Any]:
    """`options` as the task's config takes them: composite's `datasets` entries become its `DatasetSpec`s."""
    if task != "composite" or not isinstance(options.get("datasets"), list):
        return options
    from reasoning_gym.composite import DatasetSpec

    specs = [
        DatasetSpec(**{"weight": 1.0, "config": {}} | spec) if isinstance(spec, dict) else spec
        for spec in options["datasets"]
    ]
    return options | {"datasets": specs}


def _registry() -> dict[str, Any]:
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError as error:
        raise ValueError(_INSTALL_HINT) from error
    return DATASETS
