"""`dataset="reasoning_gym:<task>"` and `rewards.reasoning_gym` with the real reasoning-gym package: rows carry what
the task's own `score_answer` needs (through pyarrow and pickling), known right and wrong completions score as the task
scores them (countdown, gsm_symbolic, graph_color), the held-out split comes from another seed, bad tasks and options
fail at construction, and a tiny model fits one real step on countdown."""

from __future__ import annotations

import json
import math
import pickle
from decimal import Decimal
from fractions import Fraction

import lightning.pytorch as pl
import pandas as pd
import pytest
import reasoning_gym as rg
from datasets import Dataset
from helpers.fit_rewards import char_sum_reward

from lightning_grpo import GRPODataModule, GRPOModule
from lightning_grpo.data.preparation import VAL_SEED_OFFSET
from lightning_grpo.data.reasoning_gym import decode_metadata, encode_metadata, reasoning_gym_dataset
from lightning_grpo.rewards import reasoning_gym as reasoning_gym_reward


def gym_module(task: str, size: int = 3, **options) -> GRPODataModule:
    datamodule = GRPODataModule(
        model="tiny-random",
        dataset=f"reasoning_gym:{task}",
        dataset_size=size,
        dataset_seed=5,
        val_size=2,
        reward_funcs=["lightning_grpo.rewards.reasoning_gym"],
        **options,
    )
    datamodule.check_data()
    return datamodule


def scores(rows: Dataset, index: int, completions: list[str]) -> list[float | None]:
    """`rewards.reasoning_gym` on `completions` of row `index`, called as the rollout loop calls it (TRL's signature:
    the row's columns repeated once per completion)."""
    row = rows[index]
    columns = {name: [row[name]] * len(completions) for name in rows.column_names if name != "prompt"}
    return reasoning_gym_reward(completions, prompts=[row["prompt"]] * len(completions), **columns)


def answered(text: str) -> str:
    return f"Let me think step by step.\n<answer>{text}</answer>"


def test_countdown_rows_are_the_generators_entries_with_its_system_prompt():
    from reasoning_gym.utils import SYSTEM_PROMPTS

    datamodule = gym_module("countdown")
    rows = datamodule.train_prompts
    entries = list(rg.create_dataset("countdown", size=3, seed=5))
    assert rows["question"] == [entry["question"] for entry in entries]
    assert rows["answer"] == [entry["answer"] for entry in entries]
    assert [decode_metadata(text) for text in rows["metadata"]] == [entry["metadata"] for entry in entries]
    assert rows["prompt"][0] == [
        {"role": "system", "content": SYSTEM_PROMPTS["default"]},
        {"role": "user", "content": entries[0]["question"]},
    ]
    assert set(rows["gym_task"]) == {"countdown"} and set(rows["gym_options"]) == {"{}"}
    held_out = list(rg.create_dataset("countdown", size=2, seed=5 + VAL_SEED_OFFSET))
    assert datamodule.val_prompts["question"] == [entry["question"] for entry in held_out]
    assert not set(datamodule.val_prompts["question"]) & set(rows["question"])


def test_countdown_scores_are_the_tasks_own_for_right_wrong_and_missing_answers():
    rows = gym_module("countdown").train_prompts
    row = rows[0]
    numbers, target = json.loads(row["metadata"])["numbers"], json.loads(row["metadata"])["target"]
    other_order = " + ".join(map(str, numbers))  # right numbers, (almost surely) the wrong total
    assert eval(row["answer"]) == target and eval(other_order) != target
    completions = [
        answered(row["answer"]),
        f"<answer>{other_order}</answer> no wait <answer>{row['answer']}</answer>",  # the last answer counts
        answered(other_order),
        answered("1 + 2"),
        "I give up.",
    ]
    assert scores(rows, 0, completions) == [1.0, 1.0, 0.05, 0.05, 0.01]
    entry = rg.create_dataset("countdown", size=3, seed=5)[0]
    assert scores(rows, 0, [answered(other_order)]) == [
        rg.create_dataset("countdown", size=1).score_answer(other_order, entry)
    ]


def test_gsm_symbolic_word_problems_score_the_number_right_and_others_low():
    rows = gym_module("gsm_symbolic", size=2).train_prompts
    for index in range(2):
        answer = rows[index]["answer"]
        wrong = str(int(float(answer)) + 1)  # a number, as GSM8K's answers are
        completions = [answered(answer), answered(f"{answer}.0 dollars"), answered(wrong), answered("many"), answer]
        assert scores(rows, index, completions) == [1.0, 1.0, 0.01, 0.0, 0.0]  # untagged: no answer at all


def test_every_gsm_symbolic_row_keeps_its_fractions_and_scores_its_own_answer():
    """Some gsm_symbolic entries hold `Fraction`s in their metadata (rows 28, 36, 41, 46 of seed 5): the rows still
    build, decode to the generator's values and score their own answers 1.0."""
    rows = gym_module("gsm_symbolic", size=30).train_prompts
    entries = list(rg.create_dataset("gsm_symbolic", size=30, seed=5))
    assert [decode_metadata(text) for text in rows["metadata"]] == [entry["metadata"] for entry in entries]
    assert "__fraction__" in rows["metadata"][28]
    assert all(scores(rows, index, [answered(rows["answer"][index])]) == [1.0] for index in range(len(rows)))


def test_graph_color_scores_by_checking_a_coloring_against_metadata_with_int_keys():
    """graph_color has no single answer (None): its scorer checks the coloring against `metadata["puzzle"]`, and the
    metadata holds dicts with int keys and tuple edges, which JSON alone would not give back."""
    rows = gym_module("graph_color", size=2).train_prompts
    row = rows[0]
    assert row["answer"] is None
    metadata = decode_metadata(row["metadata"])
    assert all(isinstance(key, int) for key in metadata["possible_answer"])
    assert all(isinstance(edge, tuple) for edge in metadata["puzzle"]["edges"])
    right = json.dumps(metadata["possible_answer"])
    a, b = metadata["puzzle"]["edges"][0]
    clash = json.dumps({**metadata["possible_answer"], a: 1, b: 1})  # one edge's ends share a color
    assert scores(rows, 0, [answered(right), answered(clash), answered("red"), "none"]) == [1.0, 0.01, 0.0, 0.0]


def test_task_options_reach_the_generator_and_the_scorer():
    datamodule = gym_module("countdown", dataset_options={"min_numbers": 3, "max_numbers": 3, "system_prompt": ""})
    rows = datamodule.train_prompts
    assert all(len(json.loads(text)["numbers"]) == 3 for text in rows["metadata"])
    assert rows["prompt"][0] == [{"role": "user", "content": rows["question"][0]}]  # "" system prompt: none
    assert json.loads(rows["gym_options"][0]) == {"max_numbers": 3, "min_numbers": 3}
    assert scores(rows, 1, [answered(rows["answer"][1])]) == [1.0]


def test_rows_survive_parquet_and_pickling_and_still_score():
    rows = reasoning_gym_dataset("reasoning_gym:countdown", size=2, seed=1)
    rows = pickle.loads(pickle.dumps(rows.to_list()))
    frame = pd.DataFrame(rows)
    back = Dataset.from_pandas(frame)
    assert scores(back, 1, [answered(back[1]["answer"])]) == [1.0]
    metadata = {"grid": ((1, 2), (3, 4)), "seen": {3, 1}, "by_id": {0: "a", 2: (5,)}, "plain": [1.5, None, "x"]}
    metadata |= {"ratio": Fraction(3, 4), "price": Decimal("0.10")}
    decoded = decode_metadata(encode_metadata(metadata))
    assert decoded == metadata and type(decoded["ratio"]) is Fraction and type(decoded["price"]) is Decimal
    with pytest.raises(TypeError, match="of type object is not serialisable"):
        encode_metadata({"bad": object()})


def test_bad_task_or_options_fail_at_construction_naming_them():
    with pytest.raises(
        ValueError, match=r"no task 'countdwn'; did you mean 'countdown'( or '\w+')*\? It has \[.*'countdown'"
    ):
        GRPODataModule(model="tiny-random", dataset="reasoning_gym:countdwn")
    with pytest.raises(ValueError, match=r"\['max_nums'\] are not options of reasoning-gym's 'countdown' \(it has \["):
        GRPODataModule(model="tiny-random", dataset="reasoning_gym:countdown", dataset_options={"max_nums": 3})
    with pytest.raises(ValueError, match=r"dataset_options sets \['seed'\]: use dataset_size and dataset_seed"):
        GRPODataModule(model="tiny-random", dataset="reasoning_gym:countdown", dataset_options={"seed": 3})
    with pytest.raises(ValueError, match="reasoning-gym's 'countdown' refuses .*max_numbers must be >= min_numbers"):
        GRPODataModule(
            model="tiny-random", dataset="reasoning_gym:countdown", dataset_options={"min_numbers": 5, "max_numbers": 4}
        )


def test_a_reward_without_the_gym_columns_is_refused_at_setup():
    datamodule = GRPODataModule(
        model="tiny-random", dataset="arithmetic", dataset_size=3, reward_funcs=["lightning_grpo.rewards.reasoning_gym"]
    )
    with pytest.raises(ValueError, match=r"reward 'reasoning_gym' needs column\(s\) \['gym_task', 'metadata'\]"):
        datamodule.check_data()


@pytest.mark.timeout(300)
def test_a_tiny_model_fits_one_step_on_countdown(tmp_path, no_leaked_processes):
    """A real `Trainer.fit` on `reasoning_gym:countdown` rows: `rewards.reasoning_gym` scores every completion in the
    rollout child's reward pool with countdown's own scorer (a random policy writes no `<answer>`, so 0.01: not NaN,
    which a failing scorer would give), and `char_sum_reward` gives the groups a signal to train one step on."""
    from lightning.pytorch.loggers import CSVLogger

    datamodule = GRPODataModule(
        model="tiny-random",
        dataset="reasoning_gym:countdown",
        dataset_size=4,
        dataset_options={"min_numbers": 3, "max_numbers": 3},
        reward_funcs=["lightning_grpo.rewards.reasoning_gym", char_sum_reward],
        num_generations=4,
        max_completion_length=8,
        samples_per_row=4,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=CSVLogger(tmp_path),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(GRPOModule("tiny-random", learning_rate=1e-3), datamodule=datamodule)
    assert trainer.global_step == 1
    metrics = pd.read_csv(next(tmp_path.rglob("metrics.csv")))
    gym = metrics["rewards/reasoning_gym"].dropna()
    assert len(gym) >= 1 and all(math.isfinite(value) and 0.01 <= value <= 1.0 for value in gym)


def test_composite_mixes_tasks_and_each_row_scores_by_its_own_task():
    options = {
        "datasets": [{"name": "countdown", "config": {"min_numbers": 3, "max_numbers": 3}}, {"name": "gsm_symbolic"}]
    }
    rows = gym_module("composite", size=8, dataset_options=options).train_prompts
    sources = [json.loads(metadata)["source_dataset"] for metadata in rows["metadata"]]
    assert set(sources) == {"countdown", "gsm_symbolic"}
    assert all(scores(rows, index, [answered(rows["answer"][index])]) == [1.0] for index in range(8))
    wrong = [scores(rows, index, [answered("1")])[0] for index in range(8)]
    assert wrong == [0.05 if source == "countdown" else 0.01 for source in sources]  # each task's own partial credit
    with pytest.raises(ValueError, match=r"dataset_options\['datasets'\] names 'countdwn', not a reasoning-gym task"):
        GRPODataModule(
            model="tiny-random", dataset="reasoning_gym:composite", dataset_options={"datasets": [{"name": "countdwn"}]}
        )
