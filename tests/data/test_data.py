"""Prompt datasets: the builtin arithmetic task, local files, and clear errors for bad sources."""

from __future__ import annotations

import json

import pytest
from datasets import Dataset

from lightning_grpo.data.arithmetic import arithmetic_dataset
from lightning_grpo.data.columns import check_columns, check_columns_for_rewards, columns_needed_by
from lightning_grpo.data.sources import load_prompts


def test_arithmetic_is_reproducible_and_answers_are_right():
    a, b = arithmetic_dataset(30, seed=3), arithmetic_dataset(30, seed=3)
    assert a.to_dict() == b.to_dict()
    assert arithmetic_dataset(30, seed=4).to_dict() != a.to_dict()
    for row in a:
        question = row["prompt"][0]["content"].split("What is ")[1].split("?")[0]
        assert str(eval(question)) == row["answer"]  # noqa: S307 - our own generated digits and operators
        assert "\\boxed{}" in row["prompt"][0]["content"]
    assert {row["task"] for row in a} == {"add", "mul", "sub"}


def test_load_builtin_by_name_with_size():
    assert len(load_prompts("arithmetic", size=12)) == 12


def test_an_arithmetic_template_gives_raw_text_prompts_of_the_same_problems():
    """For a base model: `dataset_options={"template": ...}` puts each question into the text (braces of its own,
    such as `\\boxed{}`, stay as they are); the problems and answers are those of the default prompts."""
    template = "Solve it, answer in \\boxed{}.\nUser: {question}\nAssistant:"
    plain = arithmetic_dataset(6, seed=2)
    templated = load_prompts("arithmetic", size=6, seed=2, dataset_options={"template": template})
    assert templated["answer"] == plain["answer"]
    for row, original in zip(templated, plain, strict=True):
        question = original["prompt"][0]["content"].split("? ")[0] + "?"
        assert row["prompt"] == template.replace("{question}", question)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"template": "no field"}, r"dataset_options\['template'\]='no field' \(a string with \{question\}"),
        ({"templat": "{question}"}, r"keys \['templat'\] are not options of dataset='arithmetic'"),
    ],
)
def test_bad_arithmetic_options_are_refused_naming_them(options, message):
    from lightning_grpo import GRPODataModule

    with pytest.raises(ValueError, match=message):
        GRPODataModule(model="tiny-random", dataset="arithmetic", dataset_options=options)
    if "template" in options:
        with pytest.raises(ValueError, match=message):
            arithmetic_dataset(3, template=options["template"])


def test_load_jsonl_and_parquet(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "answer": str(i)} for i in range(5)]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows))
    assert load_prompts(str(jsonl))["answer"] == [str(i) for i in range(5)]
    parquet = tmp_path / "p.parquet"
    Dataset.from_list(rows).to_parquet(str(parquet))
    assert len(load_prompts(str(parquet), size=3)) == 3


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_prompts(str(tmp_path / "nope.jsonl"))


def test_missing_column_names_it_and_lists_present_ones():
    dataset = Dataset.from_dict({"question": ["x"]})
    with pytest.raises(ValueError, match=r"\['answer', 'prompt'\].*\['question'\]"):
        check_columns(dataset, {"prompt", "answer"})


def test_empty_dataset_is_an_error():
    with pytest.raises(ValueError, match="no rows"):
        load_prompts(Dataset.from_dict({"prompt": []}))


def test_the_columns_a_reward_needs_are_its_named_parameters_without_defaults():
    import functools

    from lightning_grpo.rewards import accuracy, boxed_format

    class Judge:
        def __call__(self, completions, rubric, *, strict=False, **kwargs):
            return [0.0] * len(completions)

    def needs_two(completions, prompts, answer, task, completion_ids=None, **kwargs):
        return [0.0] * len(completions)

    assert columns_needed_by(accuracy) == {"answer"} and columns_needed_by(boxed_format) == set()
    assert columns_needed_by(needs_two) == {"answer", "task"}
    assert columns_needed_by(functools.partial(needs_two, task="add")) == {"answer"}
    named = functools.update_wrapper(functools.partial(needs_two, task="add"), needs_two)  # a name for the metrics
    assert columns_needed_by(named) == {"answer"}  # the partial's signature, not the function it wraps
    assert columns_needed_by(Judge()) == {"rubric"}
    assert columns_needed_by(print) == set()  # a builtin: no named parameter without a default


def test_a_dataset_without_a_column_a_reward_needs_names_both():
    from lightning_grpo.rewards import accuracy

    prompts = Dataset.from_dict({"prompt": ["q"], "solution": ["2"]})
    with pytest.raises(
        ValueError, match=r"my data: reward 'accuracy' needs column\(s\) \['answer'\].*\['prompt', 'solution'\]"
    ):
        check_columns_for_rewards(prompts, [accuracy], source="my data")
    check_columns_for_rewards(prompts.rename_column("solution", "answer"), [accuracy], source="my data")


def test_templated_held_out_prompts_and_the_stop_strings_reach_validation():
    """The held-out prompts of a templated arithmetic task use the template too, and the contract the module
    validates with carries the data module's `stop`."""
    from lightning_grpo import GRPODataModule

    datamodule = GRPODataModule(
        model="tiny-random",
        dataset="arithmetic",
        dataset_size=4,
        val_size=2,
        prompt_format="text",
        dataset_options={"template": "Q: {question}\nA:"},
        stop=["</answer>"],
    )
    datamodule.check_data()
    assert all(row["prompt"].startswith("Q: What is ") for row in datamodule.val_prompts)
    assert datamodule.rollout_contract().stop == ("</answer>",)
