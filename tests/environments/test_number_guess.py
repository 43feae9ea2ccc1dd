"""The number-guessing environment on known games: its feedback, its reward, its solve-rate reward, its bisection
demonstrations rendered through the rollout's conversation path, and a tiny-model GRPO fit through it."""

from __future__ import annotations

import math

import pytest
from helpers.fit_rewards import char_sum_reward
from helpers.processes import live_children
from helpers.tiny import cpu_trainer

from lightning_grpo.data.number_guess import number_guess_dataset
from lightning_grpo.datamodule import GRPODataModule
from lightning_grpo.environments.number_guess import NumberGuessEnv, demonstration, solved
from lightning_grpo.module import GRPOModule
from lightning_grpo.sft.demonstrations import render_rows


def play(secret: int, guesses: list, high: int = 16) -> tuple[list[str], float]:
    env = NumberGuessEnv()
    env.reset(secret=secret, high=high)
    return [env.guess(g) for g in guesses], env.get_reward()


def test_the_feedback_points_at_the_secret_and_the_reward_falls_with_each_guess():
    assert play(11, [8, 12, 10, 11]) == (["higher", "lower", "higher", "correct: it is 11"], pytest.approx(0.7))
    assert play(5, [5]) == (["correct: it is 5"], 1.0)
    assert play(5, [1, 2, 3]) == (["higher"] * 3, 0.0)  # never found: 0
    assert play(16, list(range(1, 17)))[1] == 0.5  # found, but late: the floor
    answers, reward = play(3, [3, 3])
    assert answers[1].startswith("You already found it: 3") and reward == pytest.approx(0.9)  # extra guesses count
    answers, _ = play(3, [0, 17, "x", True, "3"])
    assert answers[:4] == [f"{g!r} is not a whole number from 1 to 16." for g in (0, 17, "x", True)]
    assert answers[4] == "correct: it is 3"  # a quoted number is read as the number


def test_a_new_game_forgets_the_last_and_a_bad_secret_is_refused():
    env = NumberGuessEnv()
    env.reset(secret=2, high=4)
    env.guess(2)
    env.reset(secret=4, high=4)
    assert (env.guesses, env.solved, env.get_reward()) == ([], False, 0.0)
    with pytest.raises(ValueError, match=r"secret=9, high=4\).*1\.\.high"):
        env.reset(secret=9, high=4)


def test_solved_reads_the_tools_answer_in_the_conversation():
    found = [{"role": "assistant", "content": ""}, {"role": "tool", "name": "guess", "content": "correct: it is 4"}]
    missed = [{"role": "tool", "name": "guess", "content": "lower"}, {"role": "assistant", "content": "correct"}]
    assert solved([found, missed, [], "correct"]) == [1.0, 0.0, 0.0, 0.0]


def test_the_dataset_is_seeded_and_bisection_solves_every_game_in_log2_guesses():
    rows = number_guess_dataset(32, seed=0)
    assert rows["secret"] == number_guess_dataset(32, seed=0)["secret"] != number_guess_dataset(32, seed=1)["secret"]
    assert set(rows["high"]) == {16} and "1 to 16" in rows[0]["prompt"][0]["content"]
    for secret in range(1, 17):
        replies = demonstration({"secret": secret, "high": 16})
        guesses = [r["tool_calls"][0]["function"]["arguments"]["number"] for r in replies[:-1]]
        answers, reward = play(secret, guesses)
        assert answers[-1] == f"correct: it is {secret}" and len(guesses) <= math.floor(math.log2(16)) + 1
        assert reward == pytest.approx(1 - 0.1 * (len(guesses) - 1))
        assert replies[-1] == {"role": "assistant", "content": f"The number is {secret}."}
    with pytest.raises(ValueError, match="high=1"):
        number_guess_dataset(4, high=1)
    with pytest.raises(ValueError, match=r"keys \['hi'\] are not options of dataset='number_guess'"):
        GRPODataModule(model="tiny-random", dataset="number_guess", dataset_options={"hi": 8}, reward_funcs=[solved])
    with pytest.raises(ValueError, match=r"dataset_options\['high'\]=1 \(a whole number, at least 2\)"):
        GRPODataModule(model="tiny-random", dataset="number_guess", dataset_options={"high": 1}, reward_funcs=[solved])


def test_a_demonstration_plays_against_a_real_environment_and_trains_only_the_guesses(tokenizer):
    rows = number_guess_dataset(2, seed=0, high=8)
    demos = render_rows(
        tokenizer, rows, demonstration, environment_factory=NumberGuessEnv, max_tool_calling_iterations=6
    )
    for row, demo in zip(rows, demos, strict=True):
        guesses = len(demonstration(row)) - 1
        assert (demo.tool_calls, demo.tool_failures) == (guesses, 0)
        context = tokenizer.decode([t for t, m in zip(demo.input_ids, demo.completion_mask, strict=True) if not m])
        trained = tokenizer.decode([t for t, m in zip(demo.input_ids, demo.completion_mask, strict=True) if m])
        assert f"correct: it is {row['secret']}" in context and "correct" not in trained  # the env's answers: context
        assert trained.count('"name": "guess"') == guesses
        assert trained.endswith(f"The number is {row['secret']}.<|im_end|>")


@pytest.mark.timeout(240)
def test_a_tiny_fit_through_the_environment_ends_and_logs_turns_and_the_solve_rate(tmp_path):
    """The tiny random model never writes a well-formed call, so `char_sum_reward` gives its groups a signal; every
    rollout still resets a NumberGuessEnv in the rollout child and is scored by it (a reward column of 0)."""
    from lightning.pytorch.loggers import CSVLogger

    datamodule = GRPODataModule(
        model="tiny-random",
        dataset="number_guess",
        dataset_size=4,
        dataset_options={"high": 4},
        reward_funcs=[char_sum_reward, solved],
        reward_weights=[1.0, 0.0, 1.0],
        environment_factory=NumberGuessEnv,
        max_tool_calling_iterations=2,
        num_generations=4,
        max_completion_length=8,
        samples_per_row=4,
    )
    logger = CSVLogger(tmp_path, name="fit")
    trainer = cpu_trainer(logger=logger, log_every_n_steps=1)
    trainer.fit(GRPOModule("tiny-random", learning_rate=1e-3), datamodule=datamodule)
    assert trainer.global_step > 0 and len(datamodule.progress.consumed) == 4
    metrics = (tmp_path / "fit" / "version_0" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"rewards/NumberGuessEnv", "rewards/solved", "rollout/turns_mean"} <= set(metrics)
    assert not live_children()
