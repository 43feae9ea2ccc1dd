"""The calculator task: exact arithmetic a 135M model cannot do in its head, meant to be solved with the `calculator`
tool (`lightning_grpo.tools.calculator`), and the tool-use demonstrations its warm start trains on.

`calculator_dataset(size, seed)` (also `GRPODataModule(dataset="calculator")`) draws, in equal shares: `mul` (a 3-4
digit number times a 2-3 digit one, "4821*37"), `div` (an exact quotient, "178377/37") and `mixed` (a product plus
or minus a 3-digit number, "312*45+678"). Every answer is an integer, scored by `lightning_grpo.rewards.accuracy`
(math_verify). Held-out problems come from another seed (the data module adds 10,000), so they are other problems.

`demonstration(row)` is the conversation a tool user would have about a row: the question, one `calculator` call
with the row's expression, the tool's result, and the final answer in `\\boxed{}`; `lightning_grpo.sft` renders it
with the policy's chat template and trains on the assistant's tokens only.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from datasets import Dataset

from .columns import ANSWER_INSTRUCTION

CALCULATOR_TASKS = ("mul", "div", "mixed")
TOOL_NAME = "calculator"


def calculator_dataset(size: int = 600, seed: int = 0) -> Dataset:
    """Exact multiplication, division and mixed expressions of 3-4 digit numbers.

    Columns: `prompt` (one user message: "What is 4821*37? Put the final answer in \\boxed{}."), `answer` (the exact
    integer result as a string), `expression` (what the calculator is asked, the question's own text) and `task`
    (`mul`, `div` or `mixed`). The same `(size, seed)` always gives the same rows.

    Raises:
        ValueError: `size` is below 1.
    """
    if size < 1:
        raise ValueError(f"`calculator_dataset(size={size})` needs at least one problem.")
    rng = np.random.default_rng(seed)
    rows: dict[str, list[Any]] = {"prompt": [], "answer": [], "expression": [], "task": []}
    for i in range(size):
        task = CALCULATOR_TASKS[i % len(CALCULATOR_TASKS)]
        expression, answer = _problem(task, rng)
        rows["prompt"].append([{"role": "user", "content": f"What is {expression}? {ANSWER_INSTRUCTION}"}])
        rows["answer"].append(str(answer))
        rows["expression"].append(expression)
        rows["task"].append(task)
    return Dataset.from_dict(rows)


def _problem(task: str, rng: np.random.Generator) -> tuple[str, int]:
    a = int(rng.integers(100, 10_000))  # 3-4 digits
    b = int(rng.integers(10, 1_000))  # 2-3 digits
    if task == "mul":
        return f"{a}*{b}", a * b
    if task == "div":
        return f"{a * b}/{b}", a
    c = int(rng.integers(100, 1_000))
    if rng.integers(2):
        return f"{a}*{b}+{c}", a * b + c
    return f"{a}*{b}-{c}", a * b - c


def tool_call(expression: str) -> dict[str, Any]:
    """One `calculator` call in the OpenAI/TRL message format (what TRL's response parser returns)."""
    return {"type": "function", "function": {"name": TOOL_NAME, "arguments": {"expression": expression}}}


def final_answer(expression: str, result: str) -> str:
    """The assistant's last turn once the tool answered: the result, boxed."""
    return f"{expression} = {result}, so the answer is \\boxed{{{result}}}."


def demonstration(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The assistant's side of a tool-use conversation about `row` (a `calculator_dataset` row): first the
    `calculator` call with `row["expression"]`, then, after the tool's result, the boxed answer `row["answer"]`.

    Only the assistant's messages are given: the tool's result comes from running the real tool when the
    demonstration is rendered (`lightning_grpo.sft.demonstrations`), as in a rollout.

    Raises:
        KeyError: the row has no `expression` or `answer` column (it is not from `calculator_dataset`).
    """
    expression, answer = row["expression"], str(row["answer"])
    return [
        {"role": "assistant", "content": "", "tool_calls": [tool_call(expression)]},
        {"role": "assistant", "content": final_answer(expression, answer)},
    ]
