"""Built-in reward functions with TRL's signature: `f(completions, prompts, completion_ids, **columns) -> rewards`.

Each returns one `float | None` per completion (`None` = not scored). A completion is a string or a conversation
(a list of `{"role", "content"}` messages); see `completion_text`. They are plain synchronous functions, meant to
run in a `RewardProcessPool` worker, where math_verify's signal-based timeouts work.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Sequence
from typing import Any

from math_verify import parse, verify

_BOXED = "\\boxed{"
# A number, its minus sign only when no digit precedes it ("45-7" holds 45 and 7; "= -7" holds -7).
_NUMBER = re.compile(r"(?<![\d.])-?\d+(?:\.\d+)?")


def completion_text(completion: str | Sequence[dict[str, Any]]) -> str:
    """The text a completion answers with.

    Args:
        completion: A string, or a list of messages; then the content of the last assistant message (the last
            message when none has the role "assistant"). Content may be a string or a list of parts
            (`{"type": "text", "text": ...}`), whose texts are joined; `None` content is "".

    Raises:
        TypeError: the completion is neither a string nor a list of message dicts.

    Example::

        from lightning_grpo.rewards import completion_text

        conversation = [
            {"role": "user", "content": "2 + 2?"},
            {"role": "assistant", "content": "4"},
        ]
        assert completion_text(conversation) == "4" and completion_text("4") == "4"
    """
    if isinstance(completion, str):
        return completion
    if not isinstance(completion, Sequence) or not all(isinstance(m, dict) for m in completion):
        raise TypeError(
            f"A completion must be a string or a list of message dicts, got {type(completion).__name__}: "
            f"{completion!r:.200}"
        )
    if not completion:
        return ""
    messages = [m for m in completion if isinstance(m, dict)]  # all of them (checked above)
    replies = [m for m in messages if m.get("role") == "assistant"] or messages
    content = replies[-1].get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def accuracy(
    completions: Sequence[Any],
    answer: Sequence[Any],
    *,
    parsing_timeout: int = 5,
    timeout_seconds: int = 5,
    **kwargs: Any,
) -> list[float | None]:
    r"""1.0 when a completion's final answer equals the gold `answer` (math_verify), else 0.0.

    The gold column `answer` holds one string or number per completion (e.g. `"12"`, `"\frac{1}{2}"`, `12`). A
    gold answer with a LaTeX command and no `$` (MATH's `\left( 3, \frac{\pi}{2} \right)`) is read as LaTeX math,
    as if written between `$`s. A gold answer math_verify cannot parse scores `None` (not scored), so a broken
    dataset row never teaches the model anything.

    The completion's answer is what math_verify's `parse` extracts with its default LaTeX and plain-expression
    targets, tried by priority: a non-empty `\boxed{...}` (two boxes parse as a set, which fails a single gold),
    then an answer after a cue such as "the final answer is" or "Answer:", then the last number or expression in
    the text. So "7 + 5 = 12\n\nThe answer is \boxed{}." counts as 12; "I think 12 but maybe 13" as 13.

    On a main thread (e.g. in a `RewardProcessPool` worker) math_verify's own limits apply (`signal.alarm`); a
    comparison over its limit scores 0.0, so a pathological answer such as `\boxed{9^{9^{9^{9}}}}` costs
    `timeout_seconds` and scores 0.0. Off the main thread they are off (math_verify raises there otherwise; it then
    logs a one-time warning) and only the caller, e.g. the pool's `timeout`, bounds a call; such an answer then runs
    for a very long time holding the GIL. Change the limits with `functools.partial(accuracy, timeout_seconds=1)`.

    Args:
        completions: Strings or conversations, see `completion_text`.
        answer: One gold answer per completion.
        parsing_timeout: math_verify's limit in whole seconds for parsing one text (main thread only).
        timeout_seconds: math_verify's limit in whole seconds for one comparison (main thread only).
        **kwargs: Other dataset columns and TRL's `prompts`, `completion_ids`; ignored.

    Raises:
        ValueError: `answer` does not have one entry per completion.

    Example::

        from lightning_grpo.rewards import accuracy

        completions = ["7 + 5 = 12, so the answer is \\boxed{12}.", "I think it is 13."]
        assert accuracy(completions, answer=["12", "12"]) == [1.0, 0.0]
    """
    if len(answer) != len(completions):
        raise ValueError(f"accuracy() got {len(completions)} completions but {len(answer)} gold answers (`answer`).")
    on_main = threading.current_thread() is threading.main_thread()
    parse_timeout = parsing_timeout if on_main else None
    verify_timeout = timeout_seconds if on_main else None
    rewards: list[float | None] = []
    golds: dict[str, list] = {}  # a group shares one gold answer: parse it once
    for completion, gold in zip(completions, answer, strict=True):
        key = str(gold)
        if key not in golds:
            golds[key] = _parse_gold(key, parse_timeout)
        gold_parsed = golds[key]
        if not gold_parsed:
            rewards.append(None)
            continue
        predicted = parse(completion_text(completion), parsing_timeout=parse_timeout)
        rewards.append(float(verify(gold_parsed, predicted, timeout_seconds=verify_timeout)))
    return rewards


def _parse_gold(gold: str, parsing_timeout: int | None) -> list:
    # math_verify reads bare `\left( 3, \frac{\pi}{2} \right)` as 3: inside `$`s it is the pair
    if "\\" in gold and "$" not in gold and _BOXED not in gold:
        parsed = parse(f"${gold}$", parsing_timeout=parsing_timeout)
        if parsed:
            return parsed
    return parse(gold, parsing_timeout=parsing_timeout)


def boxed_format(completions: Sequence[Any], **kwargs: Any) -> list[float | None]:
    r"""1.0 when a completion holds exactly one `\boxed{...}`, with balanced braces and non-blank content, else 0.0.

    An empty box (`\boxed{}`), a second box (nested or not) and an unclosed box all score 0.0. The answer itself
    is not checked; pair it with `accuracy`.

    Args:
        completions: Strings or conversations, see `completion_text`.
        **kwargs: Dataset columns and TRL's `prompts`, `completion_ids`; ignored.

    Example::

        from lightning_grpo.rewards import boxed_format

        rewards = boxed_format(["The answer is \\boxed{12}.", "\\boxed{}", "12"])
        assert rewards == [1.0, 0.0, 0.0]
    """
    return [1.0 if _single_filled_box(completion_text(completion)) else 0.0 for completion in completions]


def _single_filled_box(text: str) -> bool:
    if text.count(_BOXED) != 1:
        return False
    start = text.index(_BOXED) + len(_BOXED)
    depth = 1
    for end in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        if depth == 0:
            return bool(text[start:end].strip())
    return False


def numeric_closeness(completions: Sequence[Any], answer: Sequence[Any], **kwargs: Any) -> list[float | None]:
    r"""Partial credit for a numeric answer: `1 / (1 + |x - gold|)`, where `x` is the completion's number.

    A dense companion to `accuracy` for arithmetic-style tasks: an exact answer scores 1.0, one off by 1 scores 0.5,
    off by 9 scores 0.1, and a completion with no number 0.0, so a model that is never exactly right (a small or a
    random one, e.g. in a smoke run) still gets a signal that ranks closer answers higher. `x` is the last number
    inside the last `\boxed{...}` when there is one, else the last number in the text ("12, no 13" counts as 13).
    A gold answer that is not a plain number (`"\frac{1}{2}"`) scores `None` (not scored).

    Args:
        completions: Strings or conversations, see `completion_text`.
        answer: One gold answer per completion (a number or a string such as `"-12"` or `"2.5"`).
        **kwargs: Other dataset columns and TRL's `prompts`, `completion_ids`; ignored.

    Raises:
        ValueError: `answer` does not have one entry per completion.

    Example::

        from lightning_grpo.rewards import numeric_closeness

        rewards = numeric_closeness(["It is 12.", "It is 13.", "no idea"], answer=[12, 12, 12])
        assert rewards == [1.0, 0.5, 0.0]
    """
    if len(answer) != len(completions):
        raise ValueError(
            f"numeric_closeness() got {len(completions)} completions but {len(answer)} gold answers (`answer`)."
        )
    rewards: list[float | None] = []
    for completion, gold in zip(completions, answer, strict=True):
        target = _as_number(str(gold).strip())
        if target is None:
            rewards.append(None)
            continue
        text = completion_text(completion)
        boxed = text.rpartition(_BOXED)[2] if _BOXED in text else ""
        numbers = _NUMBER.findall(boxed.partition("}")[0]) or _NUMBER.findall(text)
        value = _as_number(numbers[-1]) if numbers else None
        rewards.append(0.0 if value is None else 1.0 / (1.0 + abs(value - target)))
    return rewards


def _as_number(text: str) -> float | None:
    if _NUMBER.fullmatch(text) is None:
        return None
    value = float(text)
    return value if math.isfinite(value) else None


# open-r1's `format_reward` (src/open_r1/rewards.py), the R1 recipe's format check, with its flags.
_THINK_ANSWER = re.compile(r"^<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>$", re.DOTALL | re.MULTILINE)


def format_reward(completions: Sequence[Any], **kwargs: Any) -> list[float | None]:
    r"""1.0 when a completion reasons inside `<think>` tags and then answers inside `<answer>` tags, else 0.0.

    open-r1's `format_reward`, the format DeepSeek-R1-style recipes reward beside accuracy: the completion starts
    with `<think>`, a newline, the reasoning, a newline and `</think>`, then on the next line `<answer>`, a newline,
    the answer, a newline and `</answer>`: `"<think>\nx + 2 = 5\n</think>\n<answer>\n3\n</answer>"`. As in open-r1 (its
    multiline `$`), `</answer>` must end a line, so text on later lines is allowed; text before `<think>`, tags on
    the same line as their content, or a missing block score 0.0. The answer is not checked: pair it with `accuracy`
    or `reasoning_gym`. Prompt for it with the same format, e.g. reasoning-gym's `"DeepSeekZero"` system prompt.

    Args:
        completions: Strings or conversations, see `completion_text`.
        **kwargs: Dataset columns and TRL's `prompts`, `completion_ids`; ignored.

    Example::

        from lightning_grpo.rewards import format_reward

        good = "<think>\nx + 2 = 5\n</think>\n<answer>\n3\n</answer>"
        assert format_reward([good, "<answer>3</answer>"]) == [1.0, 0.0]
    """
    return [1.0 if _THINK_ANSWER.match(completion_text(completion)) else 0.0 for completion in completions]


def reasoning_gym(
    completions: Sequence[Any],
    answer: Sequence[str | None],
    metadata: Sequence[str],
    gym_task: Sequence[str],
    gym_options: Sequence[str] | None = None,
    question: Sequence[str] | None = None,
    **kwargs: Any,
) -> list[float | None]:
    r"""A reasoning-gym task's own score of each completion: `score_answer(extract_answer(text), entry)`.

    For rows from `GRPODataModule(dataset="reasoning_gym:<task>")` (its columns `answer`, `metadata`, `gym_task`,
    `gym_options`, `question`; see `lightning_grpo.data.reasoning_gym`). The answer is the text of the completion's
    last `<answer>...</answer>`, as reasoning-gym's `extract_answer` takes it, or None when there is none; the task's
    `score_answer` (built once per process with the row's task options) scores it in [0, 1], often with partial
    credit: countdown gives 1.0 for an expression that uses the given numbers and hits the target, 0.05 for a wrong
    one, 0.01 for none. A row whose scorer raises scores NaN in the reward pool (counted and logged).

    Args:
        completions: Strings or conversations, see `completion_text`.
        answer: The entries' answers (None where a task checks answers without one).
        metadata: The entries' metadata as `lightning_grpo.data.reasoning_gym.encode_metadata` writes it.
        gym_task: The reasoning-gym task of each row (`"countdown"`).
        gym_options: The task options as JSON (default: the task's defaults).
        question: The entries' questions (a few tasks' scorers read it).
        **kwargs: Other dataset columns and TRL's `prompts`, `completion_ids`; ignored.

    Raises:
        ValueError: the columns do not have one entry per completion.

    Example::

        from lightning_grpo import GRPODataModule

        data = GRPODataModule(
            dataset="reasoning_gym:countdown",
            reward_funcs=[
                "lightning_grpo.rewards.reasoning_gym",
                "lightning_grpo.rewards.format_reward",
            ],
            reward_weights=[1.0, 0.1],
        )
    """
    from .data.reasoning_gym import extract_answer, score

    columns = {"answer": answer, "metadata": metadata, "gym_task": gym_task}
    columns |= {name: values for name, values in (("gym_options", gym_options), ("question", question)) if values}
    if bad := {name: len(values) for name, values in columns.items() if len(values) != len(completions)}:
        raise ValueError(f"reasoning_gym() got {len(completions)} completions but columns of lengths {bad}.")
    rewards: list[float | None] = []
    for index, completion in enumerate(completions):
        rewards.append(
            score(
                extract_answer(completion_text(completion)),
                answer=answer[index],
                metadata=metadata[index],
                task=gym_task[index],
                task_options=gym_options[index] if gym_options else "{}",
                question=question[index] if question else "",
            )
        )
    return rewards
