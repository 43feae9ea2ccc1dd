"""The builtin arithmetic task (`GRPODataModule(dataset="arithmetic")`): 2-digit a+b, 1-digit a*b and 2-digit minus
1-digit, in equal shares, each answer scored by `lightning_grpo.rewards.accuracy`."""

from __future__ import annotations

from typing import Any

import numpy as np
from datasets import Dataset

from .columns import ANSWER_INSTRUCTION

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
    if problems := option_problems({} if template is None else {"template": template}):
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


def option_problems(options: dict[str, Any]) -> list[str]:
    """What is wrong with `dataset_options` for the builtin arithmetic task (its one option is `template`)."""
    if unknown := sorted(set(options) - {"template"}):
        return [f"dataset_options keys {unknown} are not options of dataset='arithmetic' (its one option: 'template')"]
    template = options.get("template")
    if template is not None and (not isinstance(template, str) or TEMPLATE_FIELD not in template):
        return [f"dataset_options['template']={template!r} (a string with {TEMPLATE_FIELD} where the question goes)"]
    return []
