"""Every zoo family fits as a user would bring it: a checkpoint folder (a tiny random model of the family and a
tokenizer, written with `save_pretrained`), `GRPODataModule(model=folder)` and `GRPOModule(folder)` with default
options, a real `Trainer.fit` of 2 steps on the embedded generator. The fit must end by itself with every prompt group
consumed and no process left behind.
"""

from __future__ import annotations

import pytest
import torch
from helpers.fit_rewards import char_sum_reward
from helpers.model_zoo import FAMILIES, save_zoo_model
from helpers.tiny import cpu_trainer, tiny_prompts
from transformers import AutoModelForCausalLM

from lightning_grpo import GRPODataModule, GRPOModule

_PROMPTS = 2  # one group per optimizer step with the default options: 2 steps
_GENERATIONS = 4


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_user_checkpoint_of_every_family_fits_with_default_options(family, tmp_path, no_leaked_processes):
    folder = save_zoo_model(family, tmp_path / family)
    datamodule = GRPODataModule(
        model=str(folder),
        dataset=tiny_prompts(_PROMPTS),
        reward_funcs=[char_sum_reward],
        num_generations=_GENERATIONS,
        max_completion_length=8,
    )
    trainer = cpu_trainer(default_root_dir=tmp_path)
    module = GRPOModule(str(folder), learning_rate=1e-3)
    trainer.fit(module, datamodule=datamodule)

    progress = datamodule.progress
    # every group consumed; the character-sum reward gives each group a learning signal, so none is dropped
    assert (progress.trained_total, dict(progress.dropped)) == (_PROMPTS, {}), family
    assert trainer.global_step == _PROMPTS
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    trained = dict(module.policy.named_parameters())
    changed = [name for name, p in loaded.named_parameters() if not torch.equal(p, trained[name].detach())]
    assert changed, f"{family}: no weight changed by {trainer.global_step} steps"
