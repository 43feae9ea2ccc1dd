"""Built-in tools for the examples: plain functions with type hints and an `Args:` docstring, as TRL's `tools` are.

`calculator` serves the builtin arithmetic task (`configs/tools.yaml`): the policy may compute `23+19` with it before
it answers in `\\boxed{}`. It evaluates arithmetic only (numbers, + - * / // % **, parentheses), never arbitrary code.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from typing import Any

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_EXPONENT = 64
_MAX_LENGTH = 200


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression, such as "23+19" or "(7-2)*3".

    Args:
        expression: numbers combined with + - * / // % ** and parentheses.
    """
    if len(expression) > _MAX_LENGTH:
        raise ValueError(f"the expression is longer than {_MAX_LENGTH} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    value = _evaluate(tree.body)
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise ValueError(f"exponent {right} is too large")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"only numbers and + - * / // % ** are allowed, not {ast.dump(node)[:60]}")
