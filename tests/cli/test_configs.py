"""Every YAML config shipped in `lightning_grpo/configs/` builds: its class paths import, its options are accepted
and its data module loads and checks its prompts (with the tiny model standing in for the policy, so that no config
needs a download or a conversion here)."""

from __future__ import annotations

from importlib.resources import files

import pytest

from lightning_grpo.cli import cli

CONFIGS = sorted(p.name for p in files("lightning_grpo.configs").iterdir() if p.name.endswith(".yaml"))


def test_the_package_ships_its_recipes():
    assert {"smoke.yaml", "arithmetic.yaml", "lora.yaml", "tools.yaml"} <= set(CONFIGS)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", CONFIGS)
def test_a_shipped_config_builds_its_module_and_data_module(name, in_process):
    path = str(files("lightning_grpo.configs") / name)
    built = cli(["--config", path, "--model.model", "tiny-random", "--trainer.logger", "false"], run=False)
    assert built.model.model_name == built.datamodule.model_name == "tiny-random"
    assert len(built.datamodule.train_prompts) > 0
