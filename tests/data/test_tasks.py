"""The builtin tasks' table (`lightning_grpo.data.tasks`): each task's rows carry the columns it declares, and both
`load_prompts` and `check_dataset_options` read the table, so a task added there is loaded and checked."""

from __future__ import annotations

import pytest
from datasets import Dataset

from lightning_grpo.data import tasks
from lightning_grpo.data.options import check_dataset_options
from lightning_grpo.data.sources import load_prompts
from lightning_grpo.data.tasks import BUILTIN_DATASETS, REASONING_GYM, BuiltinTask, builtin_task


@pytest.mark.parametrize("name", BUILTIN_DATASETS)
def test_a_builtin_task_makes_rows_with_a_prompt_and_the_columns_it_declares(name):
    rows = load_prompts(name, size=6, seed=1)
    task = builtin_task(name)
    assert task is not None and task.name == name and len(rows) == 6
    assert set(rows.column_names) == {"prompt", *task.columns}
    assert (
        rows.to_dict() == load_prompts(name, size=6, seed=1).to_dict() != load_prompts(name, size=6, seed=2).to_dict()
    )


def test_reasoning_gym_tasks_share_one_entry_and_rows_name_no_task():
    assert builtin_task("reasoning_gym:countdown") is REASONING_GYM and builtin_task("reasoning_gym:x") is REASONING_GYM
    rows = load_prompts("reasoning_gym:basic_arithmetic", size=3, seed=0)
    assert set(rows.column_names) == {"prompt", *REASONING_GYM.columns}
    assert [
        builtin_task(source) for source in ("rows.jsonl", "openai/gsm8k", Dataset.from_dict({"prompt": ["a"]}))
    ] == [None] * 3


def test_each_task_checks_its_own_options_and_a_task_without_options_takes_none():
    with pytest.raises(ValueError, match=r"\['high'\] are not options of dataset='arithmetic'"):
        check_dataset_options("arithmetic", None, None, {"high": 8})
    check_dataset_options("number_guess", None, None, {"high": 8})
    with pytest.raises(ValueError, match=r"dataset_options\['high'\]=1 \(a whole number, at least 2\)"):
        check_dataset_options("arithmetic", "number_guess", None, {"high": 1})  # both sources get the options
    with pytest.raises(ValueError, match=r"is for a dataset_format preset or a builtin task that takes options"):
        check_dataset_options("calculator", None, None, {"high": 8})
    with pytest.raises(ValueError, match=r"reasoning-gym has no task 'no_such_task'"):
        check_dataset_options("reasoning_gym:no_such_task", None, None, None)


def test_a_task_added_to_the_table_is_loaded_and_checked_from_it(monkeypatch):
    def load(source, size, seed, options):
        return Dataset.from_dict(
            {"prompt": [f"{source} {seed} {options}"] * (size or 2), "answer": ["1"] * (size or 2)}
        )

    def option_problems(source, options):
        unknown = sorted(set(options) - {"level"})
        return [f"dataset_options {unknown} are not options of dataset={source!r}"] if unknown else []

    planted = BuiltinTask("planted", load, option_problems, ("answer",))
    monkeypatch.setitem(tasks.TASKS, "planted", planted)
    rows = load_prompts("planted", size=3, seed=5, dataset_options={"level": 2})
    assert rows["prompt"] == ["planted 5 {'level': 2}"] * 3
    check_dataset_options("planted", None, None, {"level": 2})
    with pytest.raises(ValueError, match=r"\['size'\] are not options of dataset='planted'"):
        check_dataset_options("planted", None, None, {"size": 2})
    with pytest.raises(ValueError, match="dataset='planted' is generated"):
        check_dataset_options("planted", None, "gsm8k", None)
