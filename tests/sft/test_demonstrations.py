"""Tool-use demonstrations render through the rollout's path and train only the assistant's tokens."""

from __future__ import annotations

import pytest

from lightning_grpo.data.calculator import calculator_dataset, demonstration
from lightning_grpo.rewards import accuracy
from lightning_grpo.sft.demonstrations import collate, conversation_spec, render_demonstration
from lightning_grpo.tools import calculator


def test_a_demonstration_renders_a_tool_call_and_masks_all_but_the_assistant(tokenizer):
    spec = conversation_spec(tokenizer, [calculator], max_tool_calling_iterations=2)
    row = calculator_dataset(3, seed=0)[0]
    demo = render_demonstration(spec, row["prompt"], demonstration(row))
    assert (demo.tool_calls, demo.tool_failures) == (1, 0)
    trained = tokenizer.decode([t for t, m in zip(demo.input_ids, demo.completion_mask, strict=True) if m])
    call = f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{row["expression"]}"}}}}</tool_call>'
    assert (
        trained
        == f"{call}<|im_end|>{row['expression']} = {row['answer']}, so the answer is \\boxed{{{row['answer']}}}.<|im_end|>"
    )
    context = tokenizer.decode([t for t, m in zip(demo.input_ids, demo.completion_mask, strict=True) if not m])
    assert "What is" in context and f"<|im_start|>tool\n{row['answer']}<|im_end|>" in context
    batch = collate([demo, demo], pad_token_id=0)
    assert batch["input_ids"].shape == batch["labels"].shape == (2, len(demo.input_ids))
    assert int((batch["labels"] != -100).sum()) == 2 * sum(demo.completion_mask)


def test_a_reply_whose_calls_the_parser_does_not_read_back_is_refused(tokenizer):
    spec = conversation_spec(tokenizer, [calculator], max_tool_calling_iterations=2)
    row = calculator_dataset(1, seed=0)[0]
    with pytest.raises(ValueError, match="ends with a tool call"):
        render_demonstration(spec, row["prompt"], demonstration(row)[:1])


@pytest.mark.parametrize("seed", [0, 10_000])
def test_the_tasks_answers_score_one_and_the_tool_computes_them(seed):
    rows = calculator_dataset(9, seed=seed)
    assert sorted(set(rows["task"])) == ["div", "mixed", "mul"]
    completions = [[{"role": "assistant", "content": f"\\boxed{{{calculator(e)}}}"}] for e in rows["expression"]]
    assert accuracy(completions, rows["answer"]) == [1.0] * 9
    assert accuracy([[{"role": "assistant", "content": "\\boxed{1}"}]], rows["answer"][:1]) == [0.0]
    assert calculator_dataset(9, seed=seed)["expression"] == rows["expression"]
    assert calculator_dataset(9, seed=seed + 1)["expression"] != rows["expression"]
