"""`rewards.format_reward`: open-r1's R1 format check (`<think>` block, then `<answer>` block) on known cases, on strings
and on conversations, with the same verdicts as open-r1's own regex; and it pairs with `reasoning_gym` scoring, which
reads the same `<answer>` block."""

from __future__ import annotations

import re

import pytest

from lightning_grpo.rewards import format_reward

# open-r1's `format_reward` pattern and flags (huggingface/open-r1, src/open_r1/rewards.py), as the reference
OPEN_R1 = re.compile(r"^<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>$", re.DOTALL | re.MULTILINE)

CASES = [
    ("<think>\n7 + 5 = 12\n</think>\n<answer>\n12\n</answer>", 1.0),
    ("<think>\nline one\nline two\n</think>\n<answer>\n\\boxed{12}\n</answer>", 1.0),  # reasoning over lines
    ("<think>\nx\n</think>\n<answer>\n12\n</answer>\nSo that's it.", 1.0),  # open-r1's multiline `$`: later lines pass
    ("<think>7 + 5 = 12</think><answer>12</answer>", 0.0),  # tags must sit on their own lines
    ("<think>\nx\n</think>\n\n<answer>\n12\n</answer>", 0.0),  # a blank line between the blocks
    ("Sure! <think>\nx\n</think>\n<answer>\n12\n</answer>", 0.0),  # text before <think>
    ("<think>\nx\n</think>\n12", 0.0),  # no answer block
    ("<answer>\n12\n</answer>", 0.0),  # no think block
    ("<think>\nx\n</think>\n<answer>\n12\n</answer> trailing", 0.0),  # `</answer>` must end its line
    ("", 0.0),
]


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_known_cases_match_open_r1(text, expected):
    assert format_reward([text]) == [expected]
    assert (OPEN_R1.match(text) is not None) == (expected == 1.0)


def test_conversations_use_the_last_assistant_message():
    good, bad = CASES[0][0], CASES[3][0]
    completions = [
        [{"role": "assistant", "content": good}],
        [{"role": "assistant", "content": bad}],
        [
            {"role": "assistant", "content": bad},
            {"role": "tool", "content": "x"},
            {"role": "assistant", "content": good},
        ],
    ]
    assert format_reward(completions, prompts=["p"] * 3, answer=["12"] * 3) == [1.0, 0.0, 1.0]


def test_the_answer_block_is_what_reasoning_gym_scores():
    from lightning_grpo.data.reasoning_gym import extract_answer

    assert extract_answer(CASES[0][0]) == "12"
    assert extract_answer("<think>\nx\n</think>\n<answer>\n1\n</answer> then <answer>2</answer>") == "2"
    assert extract_answer(CASES[6][0]) is None
