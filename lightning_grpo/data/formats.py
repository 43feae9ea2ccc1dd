r"""Dataset presets: GSM8K, MATH / MATH-500 and plain prompt + answer files, mapped to a `prompt` and an `answer`.

`GRPODataModule(dataset=..., dataset_format=...)` applies one to the training and the held-out prompts, so
`lightning_grpo.rewards.accuracy` (math_verify) can score a completion's `\boxed{...}` against the final answer:

- `"gsm8k"`: `question`, and `answer` ending in `#### 72` (GSM8K's worked solution). `answer` becomes the text after
  the last `####` without thousands separators, `$` or a final period (`#### 1,234` → `1234`, `#### -3.5` → `-3.5`);
  the worked solution moves to `solution`.
- `"math"`: `problem`, `solution` with a `\boxed{...}` (MATH), and optionally `answer` (MATH-500 has one). `answer` is
  the row's own `answer` when it is non-blank, else the content of the last `\boxed{...}` (or `\fbox{...}`) of
  `solution`, nested braces included (`\boxed{\frac{1}{2}}` → `\frac{1}{2}`; `\boxed 5` → `5`).
- `"prompt_answer"`: `prompt` (a string or chat messages) and `answer`, used as they are (`answer` as a string).

`prompt` is the question followed by a blank line and the instruction `"Put the final answer in \boxed{}."` (for
`"prompt_answer"`, no instruction unless given). Every other column is kept.

Options (`dataset_options`): the column names (`question_key`/`problem_key`/`prompt_key`, `solution_key`,
`answer_key`) and `instruction` (the sentence appended to the prompt; `""` for none). Column names, not a
`preprocess` callable: they fit in a YAML config and a checkpoint's hyper-parameters, which a function does not; any
other mapping is a `Dataset.map` before passing the `Dataset` itself as `dataset=`.

A row whose answer cannot be extracted (no `####`, no `\boxed{}`, unbalanced braces, a blank answer) is an error
that names the rows and the column, never a silent drop: a preset that silently loses rows hides a wrong preset.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Literal

from datasets import Dataset

from .columns import ANSWER_INSTRUCTION

DatasetFormat = Literal["gsm8k", "math", "prompt_answer"]

#: Each preset's options and their defaults (`dataset_options` may set any of them).
FORMAT_OPTIONS: dict[str, dict[str, str]] = {
    "gsm8k": {"question_key": "question", "answer_key": "answer", "instruction": ANSWER_INSTRUCTION},
    "math": {
        "problem_key": "problem",
        "solution_key": "solution",
        "answer_key": "answer",
        "instruction": ANSWER_INSTRUCTION,
    },
    "prompt_answer": {"prompt_key": "prompt", "answer_key": "answer", "instruction": ""},
}
DATASET_FORMATS = tuple(FORMAT_OPTIONS)

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?:\D|$))")
_SHOWN_BAD_ROWS = 5


def format_option_problems(dataset_format: str, options: dict[str, Any]) -> list[str]:
    """What is wrong with `dataset_options` for this preset: unknown keys, or values that are not strings."""
    allowed = FORMAT_OPTIONS[dataset_format]
    problems = [
        f"dataset_options key {key!r} is not an option of dataset_format={dataset_format!r} (it has {sorted(allowed)})"
        for key in options
        if key not in allowed
    ]
    problems += [
        f"dataset_options[{key!r}]={value!r} (must be a string)"
        for key, value in options.items()
        if key in allowed and not isinstance(value, str)
    ]
    return problems


def apply_format(dataset: Dataset, dataset_format: str, options: dict[str, Any] | None, *, source: str) -> Dataset:
    """`dataset` with `prompt` and `answer` columns made by the preset `dataset_format` (see the module docstring).

    Args:
        dataset: the rows as loaded (already cut to `dataset_size`).
        dataset_format: `"gsm8k"`, `"math"` or `"prompt_answer"`.
        options: overrides of the preset's column names and instruction (`FORMAT_OPTIONS`).
        source: how errors name the dataset, e.g. "`GRPODataModule(dataset='gsm8k.jsonl')`".

    Raises:
        ValueError: a column the preset reads is missing, or rows whose answer cannot be extracted (their indices).
    """
    if dataset_format not in FORMAT_OPTIONS:
        raise ValueError(f"dataset_format={dataset_format!r} is not one of {list(DATASET_FORMATS)} (or None).")
    if problems := format_option_problems(dataset_format, options or {}):
        raise ValueError(f"{source}: {'; '.join(problems)}.")
    opts = FORMAT_OPTIONS[dataset_format] | dict(options or {})
    if dataset_format == "gsm8k":
        return _gsm8k(dataset, opts, source)
    if dataset_format == "math":
        return _math(dataset, opts, source)
    return _prompt_answer(dataset, opts, source)


def gsm8k_final_answer(text: str) -> str | None:
    """The final answer of a GSM8K solution: the text after its last `####`, as a plain number where it is one
    (`"... #### 1,234"` → `"1234"`, `"#### $-5."` → `"-5"`); None when there is no `####` or nothing after it."""
    if "####" not in text:
        return None
    final = text.rpartition("####")[2].strip()
    final = _THOUSANDS.sub("", final).replace("$", "").strip().rstrip(".").strip()
    return final or None


def last_boxed(text: str) -> str | None:
    r"""The content of the last `\boxed{...}` (or `\fbox{...}`) in `text`, nested braces kept (`\boxed{\frac{1}{2}}`
    → `\frac{1}{2}`); `\boxed 5` gives `5`. None when there is none, it is unclosed or it is blank."""
    start, command = max((text.rfind(command), command) for command in _BOX_COMMANDS)
    if start < 0:
        return None
    rest = text[start + len(command) :]
    if not rest.startswith("{"):
        # `\boxed 5`: MATH writes a few one-token answers without braces
        token = rest.strip().split("$")[0].split()
        return token[0] if rest[:1].isspace() and token else None
    depth = 0
    for index, char in enumerate(rest):
        if char in "{}" and index > 0 and rest[index - 1] == "\\":
            continue  # `\{` and `\}` are literal braces
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth == 0:
            content = rest[1:index].strip()
            return content or None
    return None


def _gsm8k(dataset: Dataset, opts: dict[str, str], source: str) -> Dataset:
    question, answer = opts["question_key"], opts["answer_key"]
    _require(dataset, {question, answer}, "gsm8k", source)
    solutions = [_text(value) for value in dataset[answer]]
    finals = _extract(solutions, gsm8k_final_answer, source, answer, "no '#### <final answer>' line")
    prompts = [_prompt(_text(text), opts["instruction"]) for text in dataset[question]]
    return _with_columns(dataset, {"prompt": prompts, "answer": finals, "solution": solutions})


def _math(dataset: Dataset, opts: dict[str, str], source: str) -> Dataset:
    problem, solution, answer = opts["problem_key"], opts["solution_key"], opts["answer_key"]
    has_answer = answer in dataset.column_names
    _require(dataset, {problem} if has_answer else {problem, solution}, "math", source)
    given = [_text(value).strip() for value in dataset[answer]] if has_answer else [""] * len(dataset)
    solutions = (
        [_text(value) for value in dataset[solution]] if solution in dataset.column_names else [""] * len(dataset)
    )
    what = f"a blank `{answer}` and no \\boxed{{...}} in `{solution}`" if has_answer else "no closed \\boxed{...}"
    finals = _extract(
        list(zip(given, solutions, strict=True)),
        lambda pair: pair[0] or last_boxed(pair[1]),
        source,
        answer if has_answer else solution,
        what,
    )
    prompts = [_prompt(_text(text), opts["instruction"]) for text in dataset[problem]]
    return _with_columns(dataset, {"prompt": prompts, "answer": finals})


def _prompt_answer(dataset: Dataset, opts: dict[str, str], source: str) -> Dataset:
    prompt, answer = opts["prompt_key"], opts["answer_key"]
    _require(dataset, {prompt, answer}, "prompt_answer", source)
    finals = _extract(
        list(dataset[answer]), lambda v: None if v is None else str(v).strip() or None, source, answer, "no answer"
    )
    instruction = opts["instruction"]
    prompts = [
        _prompt(p, instruction) if isinstance(p, str) else _messages_prompt(p, instruction) for p in dataset[prompt]
    ]
    return _with_columns(dataset, {"prompt": prompts, "answer": finals})


def _require(dataset: Dataset, columns: set[str], dataset_format: str, source: str) -> None:
    if missing := sorted(columns - set(dataset.column_names)):
        keys = [key for key in FORMAT_OPTIONS[dataset_format] if key.endswith("_key")]
        raise ValueError(
            f"{source} has no column(s) {missing} for dataset_format={dataset_format!r}; it has "
            f"{dataset.column_names}. Name your columns with dataset_options ({', '.join(keys)}), or pick the "
            f"dataset_format that matches the file ({', '.join(map(repr, DATASET_FORMATS))})."
        )


def _extract(values: list[Any], extract: Callable[[Any], str | None], source: str, column: str, what: str) -> list[str]:
    finals = [extract(value) for value in values]
    bad = [index for index, final in enumerate(finals) if final is None]
    if bad:
        shown = ", ".join(map(str, bad[:_SHOWN_BAD_ROWS])) + (", ..." if len(bad) > _SHOWN_BAD_ROWS else "")
        raise ValueError(
            f"{source}: {len(bad)} of {len(values)} rows have {what} (column `{column}`), so their final answer "
            f"cannot be extracted: rows {shown} (first: {values[bad[0]]!r:.200}). Fix or drop those rows, or pick "
            "the dataset_format (and dataset_options column names) that matches the file."
        )
    return finals  # type: ignore[return-value]


def _prompt(text: str, instruction: str) -> str:
    return f"{text.strip()}\n\n{instruction}" if instruction else text


def _messages_prompt(messages: list[dict[str, Any]], instruction: str) -> list[dict[str, Any]]:
    if not instruction:
        return messages
    *head, last = messages
    return [*head, {**last, "content": _prompt(last["content"], instruction)}]


def _text(value: Any) -> str:
    return "" if value is None else str(value)


def _with_columns(dataset: Dataset, columns: dict[str, list[Any]]) -> Dataset:
    dataset = dataset.remove_columns([name for name in columns if name in dataset.column_names])
    if not dataset.column_names:  # a dataset without columns has no rows to add columns to
        return Dataset.from_dict(columns)
    for name, values in columns.items():
        dataset = dataset.add_column(name, values)
    return dataset
