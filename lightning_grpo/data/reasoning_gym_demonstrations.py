"""Warm-start demonstrations for reasoning-gym tasks (`lightning-grpo sft`'s `sft.demonstration`).

A small policy often never writes the `<answer>...</answer>` tags the tasks' scorers read, so every completion of a
group scores the same and GRPO has nothing to learn from. A few demonstrations in the format fix that:

- `demonstration`: any task with a reference answer: the answer inside the tags;
- `countdown_demonstration`: countdown's reference expression worked out one operation at a time, then the
  expression inside the tags (the reasoning the task's system prompt asks for, short enough for a small model).

Both take a row of `GRPODataModule(dataset="reasoning_gym:<task>")` and return the assistant's one message.
"""

from __future__ import annotations

import ast
import operator
from fractions import Fraction
from typing import Any

from .reasoning_gym import decode_metadata

_OPERATORS = {ast.Add: ("+", operator.add), ast.Sub: ("-", operator.sub), ast.Mult: ("*", operator.mul),
              ast.Div: ("/", operator.truediv)}  # fmt: skip


def demonstration(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The row's reference answer inside `<answer>` tags, as the assistant's reply.

    Raises:
        ValueError: the row has no reference answer (tasks with many right answers, e.g. `rush_hour`, score by
            checking and give none).
    """
    answer = row.get("answer")
    if answer is None:
        raise ValueError(
            f"reasoning-gym's {row.get('gym_task')!r} row has no reference answer to demonstrate: write an "
            "`sft.demonstration` for the task that builds one."
        )
    return [{"role": "assistant", "content": f"<answer>{answer}</answer>"}]


def countdown_demonstration(row: dict[str, Any]) -> list[dict[str, Any]]:
    """Countdown's reference expression (its metadata's `expression`), each operation computed in turn, then the
    expression inside `<answer>` tags, e.g. for `12*(30 - 22)` and the target 96: "30 - 22 = 8, 12 * 8 = 96. That
    makes 96, using each number once.\\n<answer>12*(30 - 22)</answer>".

    Raises:
        KeyError: the row is not a countdown row (no `metadata` with an `expression` and a `target`).
        ValueError: the expression is not plain arithmetic on numbers, or does not make the target.
    """
    metadata = decode_metadata(row["metadata"])
    expression, target = metadata["expression"], metadata["target"]
    steps: list[str] = []
    value = _worked(ast.parse(expression, mode="eval").body, steps)
    if value != target:
        raise ValueError(f"countdown's expression {expression!r} makes {_number(value)}, not the target {target}.")
    reasoning = f"{', '.join(steps)}. That makes {target}, using each number once."
    return [{"role": "assistant", "content": f"{reasoning}\n<answer>{expression}</answer>"}]


def _worked(node: ast.AST, steps: list[str]) -> Fraction:
    """The exact value of an arithmetic expression's `node`, appending "a op b = c" for each operation, innermost
    first."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_worked(node.operand, steps)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _worked(node.left, steps), _worked(node.right, steps)
        symbol, apply = _OPERATORS[type(node.op)]
        if symbol == "/" and right == 0:
            raise ValueError("countdown's expression divides by zero.")
        value = apply(left, right)
        steps.append(f"{_number(left)} {symbol} {_number(right)} = {_number(value)}")
        return value
    raise ValueError(f"countdown's expression has {ast.dump(node)!r}, not plain arithmetic on numbers.")


def _number(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"
