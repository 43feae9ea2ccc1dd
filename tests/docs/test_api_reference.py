"""The Python API reference: every public name is on a page or declared internal, every user-facing class and
function has an `Example::`, every example of a public docstring is valid Python, and the cheap ones run as written."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import sys
import textwrap
from pathlib import Path

import pytest

import lightning_grpo
import lightning_grpo.callbacks

GEN = Path(__file__).resolve().parents[2] / "docs" / "_gen"
_HEADER = re.compile(r"^( *)Examples?::?$")


def _api_pages():
    if str(GEN) not in sys.path:
        sys.path.insert(0, str(GEN))
    return importlib.import_module("api_pages")


def _resolve(path: str):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def examples_in(doc: str) -> list[str]:
    """The code of each `Example::` (or Google `Example:`) block of `doc`: the lines indented under the header,
    dedented, without Markdown fences."""
    lines = inspect.cleandoc(doc).splitlines()
    blocks = []
    for index, line in enumerate(lines):
        header = _HEADER.match(line)
        if not header:
            continue
        body = []
        for following in lines[index + 1 :]:
            if following.strip() and len(following) - len(following.lstrip()) <= len(header.group(1)):
                break  # the next section or paragraph
            body.append(following)
        code = textwrap.dedent("\n".join(body)).strip("\n")
        blocks.append("\n".join(line for line in code.splitlines() if not line.lstrip().startswith("```")))
    return blocks


def _public_docstrings() -> dict[str, str]:
    """Every public docstring: the facade's names, the callbacks', the builtin rewards', and their public methods."""
    objects = {f"lightning_grpo.{name}": getattr(lightning_grpo, name) for name in lightning_grpo.__all__}
    objects |= {
        f"lightning_grpo.callbacks.{n}": getattr(lightning_grpo.callbacks, n) for n in lightning_grpo.callbacks.__all__
    }
    objects |= {path: _resolve(path) for path in _api_pages().documented()}
    docs = {}
    for path, obj in objects.items():
        if not callable(obj):
            continue  # a constant: its `#:` comment is its documentation
        docs[path] = inspect.getdoc(obj) or ""
        if inspect.isclass(obj):
            for name, member in vars(obj).items():
                if not name.startswith("_") and callable(member) and member.__doc__:
                    docs[f"{path}.{name}"] = inspect.getdoc(member) or ""
    return docs


def test_examples_in_reads_each_indented_block_and_stops_at_the_next_section():
    doc = """Summary.

    Example::

        x = 1

        y = x + 1

    Note:
        not code.

    Examples:
        ```python
        z = 3
        ```
    """
    assert examples_in(doc) == ["x = 1\n\ny = x + 1", "z = 3"]


def test_every_public_name_is_on_a_reference_page_or_declared_internal():
    pages = _api_pages()
    documented = pages.documented()
    for name in lightning_grpo.__all__:
        on_page = f"lightning_grpo.{name}" in documented
        assert on_page != (name in pages.INTERNAL), (
            f"lightning_grpo.{name}: put it on one page of docs/_gen/api_pages.py PAGES or in INTERNAL (not both)"
        )
    for name in lightning_grpo.callbacks.__all__:
        assert f"lightning_grpo.callbacks.{name}" in documented, f"the callbacks page lacks {name}"
    assert not pages.INTERNAL - set(lightning_grpo.__all__), "INTERNAL names something that is not public"
    for path in documented:
        _resolve(path)  # a page names only what exists


def test_every_user_facing_class_and_function_has_an_example():
    missing = [
        path
        for path in _api_pages().documented()
        if callable(obj := _resolve(path)) and not examples_in(inspect.getdoc(obj) or "")
    ]
    assert not missing, f"these docstrings need an `Example::` block: {missing}"


def test_every_example_of_a_public_docstring_is_valid_python():
    checked = 0
    for path, doc in _public_docstrings().items():
        for index, code in enumerate(examples_in(doc)):
            try:
                ast.parse(code)
            except SyntaxError as error:
                pytest.fail(f"{path}'s Example {index} is not valid Python: {error}\n{code}")
            checked += 1
    assert checked >= 30, f"only {checked} examples found: is the block reader broken?"


def test_every_example_on_a_reference_page_fits_88_columns():
    """The reference shows examples in an indented column about 90 characters wide: a longer line is cut."""
    long = [
        f"{path}: {len(line)} chars: {line[:60]}"
        for path in _api_pages().documented()
        if callable(obj := _resolve(path))
        for code in examples_in(inspect.getdoc(obj) or "")
        for line in code.splitlines()
        if len(line) > 88
    ]
    assert not long, "example lines wider than 88 columns (re-wrap them):\n" + "\n".join(long)


# Cheap to run: no fit, no process. The class examples that fit are run by test_class_examples.py.
RUNNABLE = [
    "lightning_grpo.rewards.accuracy",
    "lightning_grpo.rewards.boxed_format",
    "lightning_grpo.rewards.format_reward",
    "lightning_grpo.rewards.numeric_closeness",
    "lightning_grpo.rewards.completion_text",
    "lightning_grpo.compute_group_advantages",
    "lightning_grpo.LossOptions",
    "lightning_grpo.grpo_loss",
    "lightning_grpo.policy_loss",
    "lightning_grpo.AutoPrecision",
    "lightning_grpo.PolicySpec",
    "lightning_grpo.TrainerScorer",
    "lightning_grpo.FeatureMatchingScorer",
    "lightning_grpo.make_weight_transfer",
    "lightning_grpo.RolloutSource",
]


@pytest.mark.parametrize("path", RUNNABLE)
def test_the_example_runs_as_written(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (code,) = examples_in(inspect.getdoc(_resolve(path)) or "")
    exec(compile(code, f"<{path} Example>", "exec"), {"__name__": "example"})
