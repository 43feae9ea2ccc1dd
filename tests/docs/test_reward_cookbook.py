"""The reward cookbook's recipes (docs/snippets/reward_*.py, included by docs/guides/reward-cookbook.md): each one
called on sample completions, the judge on the tiny model, and five of them as reward columns of a real fit."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import time
from pathlib import Path
from types import ModuleType

import cloudpickle
import pandas as pd
import pytest
from datasets import Dataset
from helpers.fit_rewards import char_sum_reward
from helpers.tiny import cpu_trainer, tiny_datamodule
from lightning.pytorch.loggers import CSVLogger

from lightning_grpo import GRPOModule

DOCS = Path(__file__).resolve().parents[2] / "docs"
SNIPPETS = DOCS / "snippets"
RECIPES = ("reward_from_column", "reward_abstain", "reward_async", "reward_format", "reward_length", "reward_judge")


def recipe(name: str) -> ModuleType:
    """A snippet imported from its file; its functions pickle by value, so the rollout child can load them."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SNIPPETS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        cloudpickle.register_pickle_by_value(module)
    return sys.modules[name]


def chat(*texts: str) -> list[list[dict]]:
    return [[{"role": "assistant", "content": text}] for text in texts]


def test_the_page_includes_every_recipe_and_no_line_is_longer_than_88():
    page = (DOCS / "guides" / "reward-cookbook.md").read_text()
    for name in RECIPES:
        assert f'--8<-- "{name}.py"' in page, f"the cookbook does not include {name}.py"
        long = [n for n, line in enumerate((SNIPPETS / f"{name}.py").read_text().splitlines(), 1) if len(line) > 88]
        assert not long, f"{name}.py lines {long} are longer than 88 characters (the page's code width)"


def test_a_column_arrives_by_name():
    keyword_coverage = recipe("reward_from_column").keyword_coverage
    completions = chat("Paris is the capital of France.", "It is Paris.", "No idea.")
    rewards = keyword_coverage(completions, keywords=[["paris", "france"]] * 3, prompts=[None] * 3)
    assert rewards == [1.0, 0.5, 0.0]
    assert keyword_coverage(["paris"], keywords=[["Paris"]]) == [1.0]  # raw-text completions are strings


def test_abstaining_returns_none_for_a_row_without_an_answer():
    exact_answer = recipe("reward_abstain").exact_answer
    rewards = exact_answer(chat("Let me see.\n12", "12 or 13", "Anything."), answer=["12", "12", None])
    assert rewards == [1.0, 0.0, None]


def test_the_async_reward_awaits_every_completion_concurrently():
    verified = recipe("reward_async").verified
    completions = chat(*[f"the answer is {i}" for i in range(50)])
    started = time.perf_counter()
    rewards = asyncio.run(verified(completions, answer=["7"] * 50))
    elapsed = time.perf_counter() - started
    assert rewards == [1.0 if i == 7 else 0.0 for i in range(50)]
    assert elapsed < 0.01 * 50 / 2, f"{elapsed:.2f} s: the 50 checks of 0.01 s each did not overlap"


def test_the_format_reward_gives_partial_credit():
    answer_tags = recipe("reward_format").answer_tags
    completions = chat("so <answer>12</answer>", "<answer> </answer>", "<answer>1</answer><answer>2</answer>", "12")
    assert answer_tags(completions) == [1.0, 0.5, 0.5, 0.0]


def test_the_length_penalties_follow_trl_and_count_tokens():
    length = recipe("reward_length")
    ids = [[1] * 40, [1] * 56, [1] * 64, [1] * 70]
    assert length.soft_overlong(completion_ids=ids) == [0.0, -0.5, -1.0, -1.0]
    assert length.token_cost(completion_ids=[[1] * 10, []]) == pytest.approx([-0.1, 0.0])
    assert length.soft_overlong.__name__ == "soft_overlong_punishment_reward"  # its column: rewards/<that>


def test_the_judge_scores_with_a_local_model(tmp_path, tokenizer, tiny_model):
    """The tiny random Llama stands in for the judge: a probability per completion, the same for the same text."""
    tiny_model.save_pretrained(tmp_path / "judge")
    tokenizer.save_pretrained(tmp_path / "judge")
    judge = recipe("reward_judge").Judge(str(tmp_path / "judge"))
    prompts = [[{"role": "user", "content": "What is 2 + 2?"}]] * 3
    scores = judge(chat("4", "5", "4"), prompts=prompts)
    assert all(0.0 < score < 1.0 for score in scores) and scores[0] == scores[2] != scores[1]
    shipped = cloudpickle.loads(cloudpickle.dumps(judge))  # what a reward worker gets: the name, not the model
    assert shipped._loaded is None and shipped(chat("4"), prompts=prompts[:1]) == scores[:1]


@pytest.mark.timeout(300)
def test_the_recipes_train_as_reward_columns_of_a_fit(tmp_path, no_leaked_processes):
    """Column, abstaining, async, format and length rewards in one fit: each column logged, no call failed (the
    abstaining one scores only the rows with an answer, so a step may have no value for it)."""
    recipes = [
        recipe("reward_from_column").keyword_coverage,
        recipe("reward_abstain").exact_answer,
        recipe("reward_async").verified,
        recipe("reward_format").answer_tags,
        recipe("reward_length").token_cost,
    ]
    prompts = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"Say {i}."}] for i in range(8)],
            "keywords": [["a", "e", str(i)] for i in range(8)],
            "answer": [str(i) if i % 2 else None for i in range(8)],
        }
    )
    data = tiny_datamodule(8, dataset=prompts, reward_funcs=[char_sum_reward, *recipes])  # char_sum: a signal
    trainer = cpu_trainer(logger=CSVLogger(tmp_path), log_every_n_steps=1)
    trainer.fit(GRPOModule("tiny-random", learning_rate=1e-3), datamodule=data)

    assert trainer.global_step >= 1
    metrics = pd.read_csv(next(tmp_path.rglob("metrics.csv")))
    for name in ("keyword_coverage", "verified", "answer_tags", "token_cost"):
        values = metrics[f"rewards/{name}"].dropna()
        assert len(values) and values.between(-1, 1).all(), name
    assert metrics["reward_pool/errors_total"].dropna().iloc[-1] == 0
    assert metrics["reward_pool/calls_total"].dropna().iloc[-1] > 0
