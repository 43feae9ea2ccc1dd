"""The recipe command (`lightning_grpo.cli.recipe`): its arguments reach the right step, its table reads the
metrics the fit logged, and the whole recipe (baseline, warm start, GRPO) runs end to end on the tiny model."""

from __future__ import annotations

import json
from importlib.resources import files

import pytest
from helpers.processes import live_children

from lightning_grpo.cli.recipe import format_table, main, split_arguments, training_means, validation_rows


def test_sft_arguments_go_to_the_warm_start_and_the_rest_to_the_fit():
    own, sft, fit = split_arguments(
        ["--config", "c.yaml", "--sft.epochs", "2", "--trainer.max_steps", "3", "--sft.seed=5", "--held_out", "val/x"]
    )
    assert (own.config, own.held_out, own.baseline_without_tools, own.reuse_warm_start) == (
        "c.yaml",
        "val/x",
        False,
        False,
    )
    assert sft == ["--sft.epochs", "2", "--sft.seed=5"] and fit == ["--trainer.max_steps", "3"]
    with pytest.raises(SystemExit):
        split_arguments(["--sft.epochs", "2"])  # no --config


def test_the_table_shows_each_models_score_and_tool_use_and_training_first_and_last_steps(tmp_path):
    csv = tmp_path / "metrics.csv"
    csv.write_text(
        "epoch,step,val/rewards/accuracy,val/tools/call_frequency,val/turns_mean,tools/call_frequency,rollout/turns_mean\n"
        "0,0,0.25,0.5,1.5,,\n"
        "0,0,,,,0.0,1.0\n"
        "0,1,,,,1.0,2.0\n"
        "0,2,,,,1.0,2.0\n"
        "0,2,0.75,1.0,2.0,,\n"
    )  # fmt: skip
    before, after = validation_rows(csv)
    assert before == {"val/rewards/accuracy": 0.25, "val/tools/call_frequency": 0.5, "val/turns_mean": 1.5}
    assert after["val/rewards/accuracy"] == 0.75
    training = training_means(csv, steps=1)
    assert training["tools/call_frequency"] == {"first": 0.0, "last": 1.0}
    assert training["rollout/turns_mean"] == {"first": 1.0, "last": 2.0}
    result = {
        "held_out": "val/rewards/accuracy",
        "models": {"base model": {"val/rewards/accuracy": 0.1}, "after the warm start": before, "after GRPO": after},
        "training": training,
        "optimizer_steps": 3,
        "fit_minutes": 1.0,
        "minutes": 2.0,
    }
    lines = format_table(result, without_tools=True).splitlines()
    assert lines[1].split() == ["base", "model", "(no", "tools)", "0.100", "0.000", "0.000", "1.000"]
    assert lines[2].split()[-4:] == ["0.250", "0.500", "nan", "1.500"]
    assert lines[3].split()[-4:] == ["0.750", "1.000", "nan", "2.000"]
    assert "tools/call_frequency 0.00 -> 1.00" in lines[4] and "rollout/turns_mean 1.00 -> 2.00" in lines[4]
    assert not any("stalled" in line for line in lines)
    stalled = format_table({**result, "stall": "8 groups in a row (no_signal: 8). HINT: raise num_generations"})
    assert stalled.splitlines()[-1] == "GRPO stalled (its groups taught nothing): 8 groups in a row (no_signal: 8)."


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_number_guess_recipe_runs_end_to_end_on_the_tiny_model(tmp_path, capsys, monkeypatch):
    """The tiny random model never writes a well-formed call, so `char_sum_reward` gives its groups a signal."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    config = str(files("lightning_grpo.configs") / "number_guess.yaml")
    result = main([
        "--config", config, "--held_out", "val/rewards/solved", "--steps", "2",
        "--sft.base_model", "tiny-random", "--sft.num_demonstrations", "4",
        "--sft.demonstration", "lightning_grpo.environments.number_guess.demonstration",
        "--model.model", str(tmp_path / "warm_start"), "--model.val_max_tokens", "8",
        "--data.dataset_size", "4", "--data.val_size", "4", "--data.dataset_options", "{high: 4}",
        "--data.num_generations", "4", "--data.max_completion_length", "8", "--data.samples_per_row", "4",
        "--data.reward_funcs", "[helpers.fit_rewards.char_sum_reward, lightning_grpo.environments.number_guess.solved]",
        "--data.reward_weights", "[1.0, 0.0, 1.0]", "--trainer.logger.init_args.save_dir", str(tmp_path),
        "--trainer.enable_progress_bar", "false",
    ])  # fmt: skip
    printed = capsys.readouterr().out
    assert (tmp_path / "warm_start" / "warm_start.json").exists()
    assert list(result["models"]) == ["base model", "after the warm start", "after GRPO"]
    assert all("val/rewards/solved" in metrics for metrics in result["models"].values())
    assert result["optimizer_steps"] > 0 and "rollout/turns_mean" in result["training"]
    assert "held-out, greedy" in printed and "after GRPO" in printed
    recipe = next(tmp_path.glob("number_guess/version_*/recipe.json"))
    assert json.loads(recipe.read_text())["models"]["after GRPO"] == result["models"]["after GRPO"]
    assert not live_children()
    assert list(cwd.iterdir()) == []  # every file went where the config says (LightningCLI's config.yaml too)


def test_reuse_warm_start_finds_a_finished_warm_start_in_the_configs_folder_or_the_given_one(tmp_path):
    from lightning_grpo.cli.recipe import _warm_start_done

    config = tmp_path / "c.yaml"
    config.write_text(f"model:\n  model: {tmp_path / 'warm'}\n")
    assert not _warm_start_done(str(config), None)
    (tmp_path / "warm").mkdir()
    (tmp_path / "warm" / "warm_start.json").write_text("{}")
    assert _warm_start_done(str(config), None) and not _warm_start_done(str(config), str(tmp_path / "other"))
