"""Built-in rewards: math_verify accuracy against the `answer` column, numeric closeness, and the boxed format.

Tests that call `accuracy` on the main thread use pytest-timeout's thread method: math_verify's `signal.alarm`
would cancel the signal-based timer of pytest-timeout.
"""

from __future__ import annotations

import threading
import time

import pytest
from math_verify import parse

from lightning_grpo.rewards import accuracy, boxed_format, completion_text, numeric_closeness

POISON = "\\boxed{9^{9^{9^{9}}}}"
main_thread_timeout = pytest.mark.timeout(60, method="thread")


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": "What is 7 + 5?"}, {"role": "assistant", "content": text}]


@main_thread_timeout
def test_accuracy_scores_right_and_wrong_answers():
    completions = [
        "7 + 5 = 12\n\nThe answer is \\boxed{12}.",
        "7 + 5 = 13\n\nThe answer is \\boxed{13}.",
        "The answer is \\boxed{\\frac{24}{2}}",
        "I am not sure.",
        "",
    ]
    assert accuracy(completions, answer=["12"] * 5) == [1.0, 0.0, 1.0, 0.0, 0.0]


@main_thread_timeout
def test_accuracy_unparseable_gold_is_none_not_zero():
    assert accuracy(["\\boxed{12}", "\\boxed{12}", "12"], answer=["twelve", "", "12"]) == [None, None, 1.0]


@main_thread_timeout
def test_accuracy_accepts_numeric_and_latex_gold():
    assert accuracy(["\\boxed{12}", "the answer is \\boxed{0.5}"], answer=[12, "\\frac{1}{2}"]) == [1.0, 1.0]


@main_thread_timeout
@pytest.mark.parametrize(
    ("text", "score"),
    [
        ("\\boxed{12}, although 13 came up later", 1.0),  # a filled box wins over the last number
        ("7 + 5 = 12\n\nThe answer is \\boxed{}.", 1.0),  # an empty box: the last number counts
        ("I think 13 but maybe 12", 1.0),  # no box: the last number
        ("I think 12 but maybe 13", 0.0),
        ("\\boxed{12} or \\boxed{13}", 0.0),  # two boxes parse as a set
    ],
)
def test_accuracy_takes_the_boxed_answer_else_the_last_number(text, score):
    assert accuracy([text], answer=["12"]) == [score]


@main_thread_timeout
def test_accuracy_conversational_and_string_completions_score_the_same():
    texts = ["So \\boxed{12}.", "It is 11.", "Answer: 12"]
    assert accuracy([chat(t) for t in texts], answer=["12"] * 3) == accuracy(texts, answer=["12"] * 3) == [1, 0, 1]


def test_accuracy_works_off_the_main_thread():
    # math_verify itself refuses to run with its signal timeouts in a thread; accuracy must switch them off.
    def parse_with_timeout():
        parse("12", parsing_timeout=5)

    thread_errors, results = _run_in_thread(parse_with_timeout)
    assert thread_errors and isinstance(thread_errors[0], ValueError)

    thread_errors, results = _run_in_thread(lambda: accuracy(["\\boxed{12}", "13"], answer=["12", "12"]))
    assert not thread_errors
    assert results == [[1.0, 0.0]]


@main_thread_timeout
def test_accuracy_poison_on_main_thread_is_bounded_by_math_verify_timeout():
    started = time.monotonic()
    assert accuracy([POISON, "\\boxed{12}"], answer=["12", "12"], timeout_seconds=1) == [0.0, 1.0]
    assert 1 <= time.monotonic() - started < 10


def test_accuracy_needs_one_gold_answer_per_completion():
    with pytest.raises(ValueError, match="2 completions but 1 gold"):
        accuracy(["1", "2"], answer=["1"])


@pytest.mark.parametrize(
    ("text", "score"),
    [
        ("The answer is \\boxed{12}.", 1.0),
        ("\\boxed{\\frac{1}{2}}", 1.0),  # nested braces balance
        ("The answer is \\boxed{}.", 0.0),  # empty
        ("\\boxed{  }", 0.0),  # blank
        ("\\boxed{12} and \\boxed{13}", 0.0),  # two boxes
        ("\\boxed{\\boxed{12}}", 0.0),  # a box in a box is two
        ("\\boxed{12", 0.0),  # never closed
        ("\\boxed{\\frac{1}{2}", 0.0),  # unbalanced
        ("The answer is 12.", 0.0),
        ("", 0.0),
    ],
)
def test_boxed_format_wants_exactly_one_filled_balanced_box(text, score):
    assert boxed_format([text]) == [score]
    assert boxed_format([chat(text)]) == [score]


@pytest.mark.parametrize(
    ("text", "gold", "score"),
    [
        ("7 + 5 = 12. The answer is \\boxed{12}.", "12", 1.0),
        ("12, no 13", "12", 0.5),  # the last number counts
        ("\\boxed{x = 11} and then 99", "12", 0.5),  # the box wins over later text
        ("45-7", "7", 1.0),  # a minus after a digit is an operator
        ("so it is -7", "-7", 1.0),
        ("2.5", 2, 1 / 1.5),  # numeric gold
        ("about 21", "12", 0.1),
        ("no number here", "12", 0.0),
        ("9" * 400, "12", 0.0),  # overflows to inf: no usable number
        ("12", "\\frac{1}{2}", None),  # not a plain-number gold: not scored
    ],
)
def test_numeric_closeness_gives_partial_credit_by_distance(text, gold, score):
    assert numeric_closeness([text], answer=[gold]) == pytest.approx([score])
    assert numeric_closeness([chat(text)], answer=[gold]) == pytest.approx([score])


def test_numeric_closeness_needs_one_gold_answer_per_completion():
    with pytest.raises(ValueError, match="got 2 completions but 1 gold answers"):
        numeric_closeness(["1", "2"], answer=["1"])


def test_completion_text_takes_the_last_assistant_message():
    conversation = [
        {"role": "assistant", "content": "first"},
        {"role": "tool", "content": "tool output"},
        {"role": "assistant", "content": [{"type": "text", "text": "\\boxed"}, {"type": "text", "text": "{1}"}]},
    ]
    assert completion_text(conversation) == "\\boxed{1}"
    assert completion_text([{"role": "user", "content": "only"}]) == "only"
    assert completion_text([{"role": "assistant", "content": None}]) == ""
    assert completion_text([]) == ""
    assert completion_text("plain") == "plain"


def test_completion_text_rejects_other_types():
    with pytest.raises(TypeError, match="string or a list of message dicts, got int"):
        completion_text(12)
    with pytest.raises(TypeError, match="got list"):
        completion_text(["not a message"])


def test_rewards_return_one_entry_per_completion_of_the_declared_types():
    completions = ["\\boxed{1}", chat("2"), "x"]
    golds = ["1", "2", "bad gold"]
    for result in (
        accuracy(completions, answer=golds),
        boxed_format(completions),
        numeric_closeness(completions, golds),
    ):
        assert len(result) == len(completions)
        assert all(r is None or type(r) is float for r in result)


def _run_in_thread(fn):
    errors, results = [], []

    def target():
        try:
            results.append(fn())
        except Exception as err:
            errors.append(err)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(timeout=30)
    return errors, results
