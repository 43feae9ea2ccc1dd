"""`lightning-grpo sft`'s warm start on the tiny model: the loss on the demonstrations goes down, and the folder it
writes is a policy the GRPO fit loads, with the tool template it was trained with."""

from __future__ import annotations

import json

import pytest

from lightning_grpo.models.loading import load_policy, load_tokenizer
from lightning_grpo.sft.command import WarmStartOptions, main, warm_start


@pytest.mark.timeout(180)
def test_the_warm_start_loss_goes_down_and_the_folder_loads(tmp_path):
    options = WarmStartOptions(
        base_model="tiny-random", num_demonstrations=8, batch_size=4, epochs=6, learning_rate=5e-3, warmup_steps=1
    )
    summary = warm_start(
        options,
        dataset="calculator",
        tools=["lightning_grpo.tools.calculator"],
        output_dir=tmp_path / "warm",
        max_tool_calling_iterations=2,
    )
    assert summary["optimizer_steps"] == 12 and summary["demonstrations"] == 8
    losses = summary["losses"]
    assert sum(losses[-2:]) < 0.8 * sum(losses[:2]), losses  # the last pass over the demonstrations vs the first
    assert json.loads((tmp_path / "warm" / "warm_start.json").read_text())["loss_last"] == losses[-1]
    policy = load_policy(str(tmp_path / "warm"))
    assert sum(p.numel() for p in policy.parameters()) > 0
    assert "<tool_call>" in load_tokenizer(str(tmp_path / "warm")).chat_template


def test_bad_options_fail_in_one_message_naming_each(capsys):
    with pytest.raises(ValueError, match=r"num_demonstrations=0 .*epochs=0 .*dtype='fp8'"):
        WarmStartOptions(num_demonstrations=0, epochs=0, dtype="fp8").check()
    with pytest.raises(SystemExit) as exit_info:
        main(["--data", "{}", "--sft.output_dir", "x"])
    assert exit_info.value.code == 2 and "no task: set data.dataset" in capsys.readouterr().err


def test_a_configs_sft_section_sets_the_warm_start_and_the_command_line_overrides_it():
    """One config serves both commands of a recipe: `calculator.yaml`'s `sft:` section is the warm start's (the fit
    ignores it: `tests/cli/test_configs.py` builds the fit from the same file)."""
    from importlib.resources import files

    from lightning_grpo.sft.command import _parser

    config = str(files("lightning_grpo.configs") / "calculator.yaml")
    assert _parser().parse_args(["--config", config]).sft.num_demonstrations == 4
    overridden = _parser().parse_args(["--config", config, "--sft.num_demonstrations", "6"])
    assert overridden.sft.num_demonstrations == 6 and overridden.sft.batch_size == WarmStartOptions.batch_size
