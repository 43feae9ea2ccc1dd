"""`lightning_grpo/configs/countdown.yaml`: it parses as written (the warm start's folder, reasoning-gym's countdown
with its generator options, its own scorer), its warm start (`lightning-grpo sft`) writes worked countdown
demonstrations' model, and `lightning-grpo fit` starts from it and trains one step, in this process, with the tiny
model and small overrides (the SmolLM2 recipe itself is too long for a test)."""

from __future__ import annotations

import json
import math
from importlib.resources import files
from pathlib import Path

import pandas as pd
import pytest
import yaml

from lightning_grpo.cli import cli, main

COUNTDOWN = str(files("lightning_grpo.configs") / "countdown.yaml")


@pytest.mark.timeout(120)
def test_countdown_config_parses_with_smollm2_the_task_options_and_its_scorer(capsys, in_process):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", COUNTDOWN, "--print_config"])
    assert exit_info.value.code in (0, None)
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["model"]["model"] == "runs/countdown/warm_start"
    assert config["data"]["dataset"] == "reasoning_gym:countdown"
    assert config["data"]["dataset_options"]["max_numbers"] == 3
    assert config["data"]["reward_funcs"] == ["lightning_grpo.rewards.reasoning_gym"]
    built = cli(["--config", COUNTDOWN, "--model.model", "tiny-random", "--data.dataset_size", "3"], run=False)
    built.datamodule.check_data()
    rows = built.datamodule.train_prompts
    assert all(len(json.loads(metadata)["numbers"]) == 3 for metadata in rows["metadata"])
    assert len(built.datamodule.val_prompts) == 128


@pytest.mark.timeout(300)
def test_the_warm_start_trains_on_worked_countdown_demonstrations_and_writes_the_folder(tmp_path, in_process):
    from lightning_grpo.sft.command import main as sft

    sft_section = yaml.safe_load(Path(COUNTDOWN).read_text())["sft"]
    assert sft_section["demonstration"].endswith("reasoning_gym_demonstrations.countdown_demonstration")
    out = tmp_path / "warm_start"
    args = ["--sft.base_model", "tiny-random", "--sft.num_demonstrations", "4", "--sft.output_dir", str(out)]
    assert sft(["--config", COUNTDOWN, *args]) == 0
    summary = json.loads((out / "warm_start.json").read_text())
    assert summary["demonstrations"] == 4 and summary["optimizer_steps"] == 1
    assert summary["options"]["demonstration"] == sft_section["demonstration"]
    assert (out / "config.json").exists()


@pytest.mark.timeout(300)
def test_countdown_config_fit_starts_and_trains_one_step(tmp_path, in_process, no_leaked_processes):
    """The tiny model never writes an `<answer>`, so every completion scores countdown's 0.01 and its groups would
    carry no signal: `char_sum_reward` (the tests' reward that varies with every character) is added to train on."""
    args = ["fit", "--config", COUNTDOWN, "--model.model", "tiny-random", "--trainer.max_steps", "1"]
    args += ["--trainer.accelerator", "cpu", "--data.dataset_size", "4", "--data.val_size", "2"]
    args += ["--data.num_generations", "4", "--data.max_completion_length", "8", "--data.samples_per_row", "4"]
    args += ["--data.gradient_accumulation_steps", "1", "--trainer.val_check_interval", "1"]
    args += ["--data.reward_funcs", "[lightning_grpo.rewards.reasoning_gym, helpers.fit_rewards.char_sum_reward]"]
    built = cli(args)
    assert built.trainer.global_step == 1
    metrics = pd.read_csv(next((tmp_path / "runs" / "countdown").rglob("metrics.csv")))
    trained = metrics["rewards/reasoning_gym"].dropna()
    assert len(trained) >= 1 and all(math.isfinite(value) and 0.01 <= value <= 1 for value in trained)
    assert metrics["val/rewards/reasoning_gym"].notna().any()
