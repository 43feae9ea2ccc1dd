"""The `lightning-grpo` command: the smoke config end to end, `--print_config` round trips, the policy linked once,
and bad input failing before any process is started, with a message that names the value.

The smoke run is the installed console script in its own process session (like a user's shell); the other tests run
the command in-process through `lightning_grpo.cli.main`/`cli`.
"""

from __future__ import annotations

import math
import sys
from importlib.resources import files
from pathlib import Path

import pandas as pd
import pytest
import yaml
from helpers.processes import run_in_session

from lightning_grpo.callbacks import GRPOProgressBar
from lightning_grpo.cli import cli, main

CONFIGS = files("lightning_grpo.configs")  # the installed package data, as the command finds it
SMOKE = str(CONFIGS / "smoke.yaml")
MAIN_JOB = str(CONFIGS / "arithmetic.yaml")
LORA = str(CONFIGS / "lora.yaml")


def run_command(args: list[str], cwd: Path, timeout: float) -> tuple[int, str]:
    return run_in_session(args, log=cwd / "log.txt", timeout=timeout, cwd=cwd)


def printed_config(capsys, args: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--print_config"])
    assert exit_info.value.code in (0, None)
    return capsys.readouterr().out


@pytest.mark.timeout(300)
def test_smoke_config_fit_exits_0_logs_rewards_and_validates(tmp_path):
    command = Path(sys.executable).parent / "lightning-grpo"
    assert command.exists(), "the console script is not installed: pip install -e '.[dev]'"
    code, output = run_command([str(command), "fit", "--config", SMOKE], cwd=tmp_path, timeout=240)
    assert code == 0, output[-4000:]
    log_dir = next((tmp_path / "smoke").glob("version_*"))
    metrics = pd.read_csv(log_dir / "metrics.csv")
    rewards = metrics["reward"].dropna()
    assert len(rewards) >= 2 and all(0 <= r <= 2 and math.isfinite(r) for r in rewards)  # two reward functions
    assert metrics["val/reward"].notna().any(), "validation (val_check_interval) did not run during fit"
    assert metrics["progress/groups_consumed"].max() == 8  # it ended because every prompt's group was consumed
    assert yaml.safe_load((log_dir / "config.yaml").read_text())["model"]["model"] == "tiny-random"


@pytest.mark.timeout(120)
def test_print_config_output_is_accepted_back_as_config(tmp_path, capsys, in_process):
    first = printed_config(capsys, ["fit", "--config", SMOKE])
    (tmp_path / "printed.yaml").write_text(first)
    second = printed_config(capsys, ["fit", "--config", str(tmp_path / "printed.yaml")])
    assert second == first
    config = yaml.safe_load(first)
    assert config["model"]["model"] == "tiny-random" and "model" not in config["data"]  # written once, linked
    assert config["data"]["reward_funcs"] == [
        "lightning_grpo.rewards.numeric_closeness",
        "lightning_grpo.rewards.accuracy",
    ]
    assert config["trainer"]["max_epochs"] == -1 and config["trainer"]["logger"]["class_path"].endswith("CSVLogger")


@pytest.mark.timeout(120)
def test_main_job_config_parses_with_smollm2_and_accuracy(capsys, in_process):
    config = yaml.safe_load(printed_config(capsys, ["fit", "--config", MAIN_JOB]))
    assert config["model"]["model"] == "smollm2-135m-instruct"
    assert config["data"]["dataset"] == "arithmetic"
    assert config["data"]["reward_funcs"] == ["lightning_grpo.rewards.accuracy"]


@pytest.mark.timeout(120)
def test_lora_config_builds_a_lora_module_from_its_class_path_and_a_bad_target_exits_2_naming_the_modules(
    capsys, in_process
):
    from peft import LoraConfig

    config = yaml.safe_load(printed_config(capsys, ["fit", "--config", LORA]))
    assert config["model"]["model"] == "smollm2-135m-instruct"
    assert config["model"]["peft_config"]["class_path"] == "peft.LoraConfig"
    built = cli(["--config", LORA, "--model.model", "tiny-random"], run=False)  # SmolLM2's layers have these names
    lora = built.model.peft_config
    assert isinstance(lora, LoraConfig) and (lora.r, lora.lora_alpha, lora.target_modules) == (16, 32, "all-linear")
    with pytest.raises(SystemExit) as exit_info:
        cli(["--config", LORA, "--model.model", "tiny-random", "--model.peft_config.target_modules=[qkv]"], run=False)
    error = capsys.readouterr().err
    assert exit_info.value.code == 2 and "target_modules=['qkv']" in error and "q_proj, k_proj, v_proj" in error


def test_tools_config_gives_the_data_module_the_calculator_and_validation_its_turn_budget(in_process):
    from lightning_grpo.tools import calculator

    built = cli(["--config", str(CONFIGS / "tools.yaml")], run=False)
    assert built.datamodule.tools == (calculator,) and built.datamodule.hparams.max_tool_calling_iterations == 2
    assert built.model.model_name == "smollm2-135m-instruct" and built.model.hparams.val_max_tokens == 96


@pytest.mark.timeout(120)
def test_policy_written_once_reaches_the_data_module(capsys, in_process):
    built = cli(["--config", SMOKE, "--model.model", "tiny-random:3"], run=False)
    assert built.model.model_name == built.datamodule.model_name == "tiny-random:3"
    with pytest.raises(SystemExit) as exit_info:
        cli(["--config", SMOKE, "--data.model", "tiny-random:4"], run=False)
    assert exit_info.value.code == 2 and "data.model" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_progress_bar_is_grpo_unless_the_config_brings_one_or_turns_it_off(in_process):
    assert isinstance(cli(["--config", SMOKE], run=False).trainer.progress_bar_callback, GRPOProgressBar)
    own = cli(["--config", SMOKE, "--trainer.callbacks", "lightning.pytorch.callbacks.TQDMProgressBar"], run=False)
    assert type(own.trainer.progress_bar_callback).__name__ == "TQDMProgressBar"
    off = cli(["--config", SMOKE, "--trainer.enable_progress_bar", "false"], run=False)
    assert off.trainer.progress_bar_callback is None


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("options", "named"),
    [
        (["--data.reward_funcs=[no_such_pkg.rewards.nope]"], "no_such_pkg.rewards.nope"),
        (["--data.reward_funcs=[lightning_grpo.rewards.no_such_reward]"], "lightning_grpo.rewards.no_such_reward"),
        (["--data.dataset=missing/prompts.jsonl"], "missing/prompts.jsonl"),
        (["--data.num_generations=four"], "four"),
        (["--data.scale_rewards=sometimes"], "sometimes"),
        (["--data.num_generations=1"], "num_generations=1"),
        (["--data.dataset=questions.jsonl"], "(dataset='questions.jsonl')` has no column(s) ['prompt']"),
        (["--data.dataset=no_answers.jsonl"], "reward 'accuracy' needs column(s) ['answer']"),
        (["--data.num_generations=9"], "A group of 9 samples"),
        (["--model.model=no-such/model"], "could not load the tokenizer 'no-such/model'"),
        (["--model.optimizer=torch.optim.SGD", "--model.optimizer.lr=-1"], "Invalid learning rate: -1"),
    ],
    ids=[
        "reward_module",
        "reward_name",
        "dataset_file",
        "wrong_type",
        "not_a_choice",
        "out_of_range",
        "no_prompt_column",
        "no_column_a_reward_needs",
        "group_never_fits_a_step",
        "tokenizer",
        "optimizer_argument",
    ],
)
def test_bad_input_exits_2_with_one_line_naming_the_value_before_starting_any_process(
    options, named, tmp_path, capsys, in_process, started_processes, no_leaked_processes
):
    (tmp_path / "questions.jsonl").write_text('{"question": "What is 1+1?", "answer": "2"}\n')
    (tmp_path / "no_answers.jsonl").write_text('{"prompt": "What is 1+1?", "solution": "2"}\n')
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", SMOKE, *options])
    error = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert "Traceback" not in error
    message = error[error.rindex("error: ") :].strip()  # the parser's usage lines come before it
    assert named in message, error[-2000:]
    assert len(message.splitlines()) <= 2, message  # ours are one line; the parser's own add the expected type
    assert started_processes == []


@pytest.mark.timeout(180)
def test_validate_subcommand_scores_the_held_out_prompts(in_process, no_leaked_processes):
    done = cli(["validate", "--config", SMOKE, "--data.val_size", "4", "--model.val_max_tokens", "4"])
    metrics = done.trainer.callback_metrics
    assert {"val/reward", "val/rewards/numeric_closeness", "val/rewards/accuracy"} <= set(metrics)
    assert 0 <= float(metrics["val/reward"]) <= 2


@pytest.mark.timeout(120)
def test_main_job_takes_the_loss_options_from_the_command_line(capsys, in_process):
    """`./scripts/main.sh --model.loss_type dr_grpo --model.beta 0.04` (the main job passes its arguments to this
    command with its config): the options reach GRPOModule; a value TRL does not have exits 2 naming it."""
    built = cli(["--config", MAIN_JOB, "--model.loss_type", "dr_grpo", "--model.beta", "0.04"], run=False)
    options = built.model.loss_options
    assert options.loss_type == "dr_grpo" and options.beta == 0.04
    built = cli(["--config", MAIN_JOB, "--model.num_iterations", "2", "--data.advantage_estimator", "rloo"], run=False)
    assert built.model.hparams.num_iterations == 2 and built.datamodule.hparams.advantage_estimator == "rloo"
    with pytest.raises(SystemExit) as exit_info:
        cli(["--config", MAIN_JOB, "--model.loss_type", "ppo"], run=False)
    assert exit_info.value.code == 2 and "loss_type" in capsys.readouterr().err
