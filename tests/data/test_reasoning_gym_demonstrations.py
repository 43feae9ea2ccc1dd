"""Warm-start demonstrations of reasoning-gym tasks: every countdown demonstration works its expression out right and
scores 1.0 with the task's own scorer (real reasoning-gym), the worked steps are exact, a generic task's reference
answer scores 1.0 in its tags, rows they cannot demonstrate are refused naming why, and the warm start renders them
with the chat template and trains only the reply."""

from __future__ import annotations

import json

import pytest

from lightning_grpo.data.reasoning_gym import encode_metadata, reasoning_gym_dataset
from lightning_grpo.data.reasoning_gym_demonstrations import countdown_demonstration, demonstration
from lightning_grpo.rewards import reasoning_gym as reasoning_gym_reward
from lightning_grpo.sft.demonstrations import conversation_spec, render_demonstration

COUNTDOWN = {"min_numbers": 3, "max_numbers": 4, "min_value": 1, "max_value": 30, "min_target": 10, "max_target": 100}


def scored(rows, replies: list[list[dict]]) -> list[float]:
    """`rewards.reasoning_gym` on each row's reply, called as the rollout loop calls it."""
    columns = {name: list(rows[name]) for name in rows.column_names if name != "prompt"}
    return reasoning_gym_reward(replies, prompts=list(rows["prompt"]), **columns)


def test_every_countdown_demonstration_scores_one_with_the_tasks_own_scorer():
    rows = reasoning_gym_dataset("reasoning_gym:countdown", size=40, seed=20_000, options=COUNTDOWN)
    replies = [countdown_demonstration(row) for row in rows]
    assert scored(rows, replies) == [1.0] * 40
    assert all(
        reply[0]["content"].endswith(f"<answer>{row['answer']}</answer>")
        for row, reply in zip(rows, replies, strict=True)
    )


def countdown_row(expression: str, target: int) -> dict:
    return {"metadata": encode_metadata({"expression": expression, "target": target, "numbers": []})}


def test_the_worked_steps_are_each_operation_innermost_first_with_exact_fractions():
    (reply,) = countdown_demonstration(countdown_row("12*(30 - 22)", 96))
    assert reply == {
        "role": "assistant",
        "content": "30 - 22 = 8, 12 * 8 = 96. That makes 96, using each number once.\n<answer>12*(30 - 22)</answer>",
    }
    (reply,) = countdown_demonstration(countdown_row("7/2*4 - 1", 13))
    assert reply["content"].startswith("7 / 2 = 7/2, 7/2 * 4 = 14, 14 - 1 = 13.")


@pytest.mark.parametrize(
    ("expression", "target", "message"),
    [
        ("3 + 4", 8, "makes 7, not the target 8"),
        ("__import__('os')", 1, "not plain arithmetic"),
        ("6 / (3 - 3)", 1, "divides by zero"),
        ("2 ** 3", 8, "not plain arithmetic"),
    ],
)
def test_an_expression_that_is_not_plain_arithmetic_or_misses_the_target_is_refused(expression, target, message):
    with pytest.raises(ValueError, match=message):
        countdown_demonstration(countdown_row(expression, target))


def test_a_row_of_another_task_is_not_a_countdown_row():
    with pytest.raises(KeyError, match="expression"):
        countdown_demonstration({"metadata": json.dumps({"target": 3})})


def test_the_generic_demonstration_is_the_reference_answer_in_tags_and_scores_one():
    rows = reasoning_gym_dataset("reasoning_gym:basic_arithmetic", size=6, seed=20_000)
    replies = [demonstration(row) for row in rows]
    assert replies[0] == [{"role": "assistant", "content": f"<answer>{rows[0]['answer']}</answer>"}]
    assert scored(rows, replies) == [1.0] * 6


def test_a_task_without_a_reference_answer_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"'rush_hour' row has no reference answer.*sft.demonstration"):
        demonstration({"answer": None, "gym_task": "rush_hour"})


def test_the_warm_start_renders_a_countdown_demonstration_and_trains_only_the_reply(tokenizer):
    rows = reasoning_gym_dataset("reasoning_gym:countdown", size=1, seed=20_000, options=COUNTDOWN)
    reply = countdown_demonstration(rows[0])
    row = render_demonstration(conversation_spec(tokenizer, []), rows[0]["prompt"], reply)
    trained = tokenizer.decode([t for t, m in zip(row.input_ids, row.completion_mask, strict=True) if m])
    assert trained == reply[0]["content"] + tokenizer.eos_token
    context = tokenizer.decode([t for t, m in zip(row.input_ids, row.completion_mask, strict=True) if not m])
    assert rows[0]["question"] in context and (row.tool_calls, row.tool_failures) == (0, 0)
