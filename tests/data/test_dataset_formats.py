r"""`GRPODataModule(dataset_format=...)`: GSM8K, MATH / MATH-500 and prompt + answer files (jsonl and parquet, in
those datasets' own columns, written by the tests since the Hub is not reachable) become `prompt` + final `answer`
rows that the real `accuracy` (math_verify) scores against a completion's `\boxed{}`; the CLI takes the same option;
a tiny model fits one real step on a GSM8K-format file."""

from __future__ import annotations

import json

import lightning.pytorch as pl
import pandas as pd
import pytest

from lightning_grpo import GRPODataModule, GRPOModule
from lightning_grpo.data.formats import apply_format, gsm8k_final_answer, last_boxed
from lightning_grpo.rewards import accuracy

GSM8K_ROWS = [
    {"question": "Sam has 1,000 apples and buys 234.", "answer": "1000 + 234 = <<1000+234=1234>>1234\n#### 1,234"},
    {"question": "It is 3 degrees and drops by 10.", "answer": "3 - 10 = -7\n#### -7"},
    {"question": "Half of 7?", "answer": "7 / 2 = 3.5\n#### 3.5"},
    {"question": "A million, and change?", "answer": "#### $1,000,000."},
]
GSM8K_FINALS = ["1234", "-7", "3.5", "1000000"]
MATH_ROWS = [
    {"problem": "What is 1/2 as a fraction?", "solution": "It is $\\boxed{\\frac{1}{2}}$."},
    {"problem": "Root of 2?", "solution": "First \\boxed{1}, no: $\\boxed{\\sqrt{2}}$"},
    {"problem": "Nested?", "solution": "So $\\boxed{\\frac{\\sqrt{3}}{2^{2}}}$."},
    {"problem": "Old style?", "solution": "The answer is $\\boxed 5$."},
]
MATH_FINALS = ["\\frac{1}{2}", "\\sqrt{2}", "\\frac{\\sqrt{3}}{2^{2}}", "5"]


def write(rows: list[dict], path) -> str:
    if str(path).endswith(".parquet"):
        pd.DataFrame(rows).to_parquet(path)
    else:
        path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    return str(path)


def formatted(path: str, dataset_format: str, **options) -> GRPODataModule:
    datamodule = GRPODataModule(model="tiny-random", dataset=path, dataset_format=dataset_format, **options)
    datamodule.check_data()
    return datamodule


def boxed(answers: list[str]) -> list[str]:
    return [f"Let me think. So the answer is \\boxed{{{answer}}}." for answer in answers]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_gsm8k_final_answers_are_what_follows_the_last_hashes_and_accuracy_scores_them(tmp_path, suffix):
    path = write(GSM8K_ROWS, tmp_path / f"gsm8k{suffix}")
    datamodule = formatted(path, "gsm8k", val_dataset=path, val_size=2)
    prompts = datamodule.train_prompts
    assert prompts["answer"] == GSM8K_FINALS
    assert prompts["solution"] == [row["answer"] for row in GSM8K_ROWS]  # the worked solution is kept
    assert prompts["prompt"][0] == "Sam has 1,000 apples and buys 234.\n\nPut the final answer in \\boxed{}."
    assert datamodule.val_prompts["answer"] == GSM8K_FINALS[:2]  # the held-out file gets the same preset
    assert accuracy(boxed(["1234", "-7", "3.5", "1000000"]), prompts["answer"]) == [1.0] * 4
    assert accuracy(boxed(["1,234", "7", "3.4", "100000"]), prompts["answer"]) == [1.0, 0.0, 0.0, 0.0]


def test_math_answers_come_from_the_last_box_with_nested_braces(tmp_path):
    datamodule = formatted(write(MATH_ROWS, tmp_path / "math.jsonl"), "math")
    assert datamodule.train_prompts["answer"] == MATH_FINALS
    assert datamodule.train_prompts["prompt"][0].endswith("\n\nPut the final answer in \\boxed{}.")
    completions = boxed(["\\frac{1}{2}", "\\sqrt{2}", "\\frac{\\sqrt{3}}{4}", "5"])
    assert accuracy(completions, datamodule.train_prompts["answer"]) == [1.0] * 4
    assert accuracy(boxed(["0.4", "2", "3", "6"]), datamodule.train_prompts["answer"]) == [0.0] * 4


def test_math500_answer_column_wins_over_the_solution_and_a_blank_one_falls_back(tmp_path):
    rows = [
        {
            "problem": "Polar?",
            "solution": "... $\\boxed{(3, \\frac{\\pi}{2})}$",
            "answer": "\\left( 3, \\frac{\\pi}{2} \\right)",
        },
        {"problem": "Half?", "solution": "so $\\boxed{\\frac{1}{2}}$", "answer": ""},
        {"problem": "Count?", "solution": "no box here", "answer": "12"},
    ]
    datamodule = formatted(write(rows, tmp_path / "math500.parquet"), "math")
    answers = datamodule.train_prompts["answer"]
    assert answers == ["\\left( 3, \\frac{\\pi}{2} \\right)", "\\frac{1}{2}", "12"]
    completions = boxed(["\\left( 3, \\frac{\\pi}{2} \\right)", "0.5", "12"])
    assert accuracy(completions, answers) == [1.0, 1.0, 1.0]
    assert accuracy(boxed(["3", "2", "13"]), answers) == [0.0, 0.0, 0.0]  # a tuple's first entry is not the tuple


def test_prompt_answer_rows_are_used_as_they_are_with_answers_as_strings(tmp_path):
    rows = [{"prompt": "What is 6*7?", "answer": 42}, {"prompt": "Minus three?", "answer": -3}]
    datamodule = formatted(write(rows, tmp_path / "plain.jsonl"), "prompt_answer")
    assert datamodule.train_prompts["prompt"] == ["What is 6*7?", "Minus three?"]
    assert datamodule.train_prompts["answer"] == ["42", "-3"]
    assert accuracy(boxed(["42", "-3"]), datamodule.train_prompts["answer"]) == [1.0, 1.0]


def test_column_names_and_the_instruction_are_options(tmp_path):
    rows = [{"query": "Two and two?", "target": "#### 4"}]
    path = write(rows, tmp_path / "renamed.jsonl")
    options = {"question_key": "query", "answer_key": "target", "instruction": "Answer in \\boxed{}, please."}
    datamodule = formatted(path, "gsm8k", dataset_options=options)
    assert datamodule.train_prompts["prompt"] == ["Two and two?\n\nAnswer in \\boxed{}, please."]
    assert datamodule.train_prompts["answer"] == ["4"]
    chat = [
        {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "6*7?"}], "answer": "42"}
    ]
    datamodule = formatted(
        write(chat, tmp_path / "chat.jsonl"), "prompt_answer", dataset_options={"instruction": "Box it."}
    )
    assert datamodule.train_prompts["prompt"][0][-1] == {"role": "user", "content": "6*7?\n\nBox it."}


def test_rows_without_an_extractable_answer_are_an_error_naming_the_rows_and_the_column(tmp_path):
    rows = [*GSM8K_ROWS[:2], {"question": "?", "answer": "no final line"}, {"question": "?", "answer": "#### "}]
    datamodule = GRPODataModule(
        model="tiny-random", dataset=write(rows, tmp_path / "bad.jsonl"), dataset_format="gsm8k"
    )
    with pytest.raises(
        ValueError, match=r"2 of 4 rows have no '#### <final answer>' line \(column `answer`\).*rows 2, 3"
    ):
        datamodule.check_data()
    rows = [MATH_ROWS[0], {"problem": "?", "solution": "unclosed \\boxed{\\frac{1}{2}"}]
    datamodule = GRPODataModule(
        model="tiny-random", dataset=write(rows, tmp_path / "bad.parquet"), dataset_format="math"
    )
    with pytest.raises(ValueError, match=r"1 of 2 rows have no closed \\boxed\{...\} \(column `solution`\).*rows 1 "):
        datamodule.check_data()
    datamodule = GRPODataModule(
        model="tiny-random", dataset=write(GSM8K_ROWS, tmp_path / "g.jsonl"), dataset_format="math"
    )
    with pytest.raises(
        ValueError,
        match=r"has no column\(s\) \['problem'\] for dataset_format='math'; it has \['question', 'answer'\]\. Name "
        r"your columns with dataset_options \(problem_key, solution_key, answer_key\)",
    ):
        datamodule.check_data()


def test_bad_format_options_fail_at_construction_naming_the_value(tmp_path):
    path = write(GSM8K_ROWS, tmp_path / "g.jsonl")
    with pytest.raises(ValueError, match=r"dataset_format='gsm8k' maps a file.*dataset='arithmetic' is generated"):
        GRPODataModule(model="tiny-random", dataset="arithmetic", dataset_format="gsm8k")
    with pytest.raises(ValueError, match=r"'problem_key' is not an option of dataset_format='gsm8k'"):
        GRPODataModule(model="tiny-random", dataset=path, dataset_format="gsm8k", dataset_options={"problem_key": "q"})
    with pytest.raises(ValueError, match=r"dataset_options=\{'question_key': 'q'\} is for a dataset_format preset"):
        GRPODataModule(model="tiny-random", dataset=path, dataset_options={"question_key": "q"})
    with pytest.raises(ValueError, match=r"dataset_format='gsm8k-main' \(one of 'gsm8k', 'math', 'prompt_answer'"):
        GRPODataModule(model="tiny-random", dataset=path, dataset_format="gsm8k-main")


def test_extractors_on_known_cases():
    assert [gsm8k_final_answer(t) for t in ("a\n#### 1,234", "#### -0.5", "x #### 1 #### 2", "none")] == [
        "1234",
        "-0.5",
        "2",
        None,
    ]
    assert [
        last_boxed(t) for t in ("\\boxed{\\{1, 2\\}}", "\\fbox{7}", "\\boxed{}", "\\boxed{a", "\\boxed{x}\\boxed{y}")
    ] == [
        "\\{1, 2\\}",
        "7",
        None,
        None,
        "y",
    ]
    from datasets import Dataset

    with pytest.raises(ValueError, match="dataset_format='csv' is not one of"):
        apply_format(Dataset.from_dict({"prompt": ["x"]}), "csv", None, source="x")


@pytest.mark.timeout(120)
def test_the_cli_takes_dataset_format(tmp_path, monkeypatch):
    import sys

    from lightning_grpo.cli import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-grpo"])
    path = write(GSM8K_ROWS, tmp_path / "gsm8k.jsonl")
    args = ["--model.model", "tiny-random", "--data.dataset", path, "--data.dataset_format", "gsm8k"]
    built = cli([*args, "--data.dataset_options", '{"instruction": "Box it."}'], run=False)
    built.datamodule.check_data()
    assert built.datamodule.train_prompts["answer"] == GSM8K_FINALS
    assert built.datamodule.train_prompts["prompt"][1] == "It is 3 degrees and drops by 10.\n\nBox it."
    with pytest.raises(SystemExit) as exit_info:
        cli([*args[:4], "--data.dataset_format", "gsm9k"], run=False)
    assert exit_info.value.code == 2


@pytest.mark.timeout(240)
def test_a_tiny_model_fits_one_step_on_a_gsm8k_file(tmp_path, no_leaked_processes):
    """A real `Trainer.fit` (rollout child, reward pool, tiny random Llama): `accuracy` and `numeric_closeness` read
    the extracted `answer` in the child; the random policy's numbers give `numeric_closeness` a signal to train on."""
    path = write(GSM8K_ROWS, tmp_path / "gsm8k.jsonl")
    datamodule = GRPODataModule(
        model="tiny-random",
        dataset=path,
        dataset_format="gsm8k",
        reward_funcs=["lightning_grpo.rewards.accuracy", "lightning_grpo.rewards.numeric_closeness"],
        num_generations=4,
        max_completion_length=8,
        samples_per_row=4,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=tmp_path,
    )
    trainer.fit(GRPOModule("tiny-random", learning_rate=1e-3), datamodule=datamodule)
    assert trainer.global_step == 1
    assert datamodule.progress.trained_total >= 1
