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
from peft import LoraConfig
from transformers import AutoModelForCausalLM

from lightning_grpo import GRPODataModule, GRPOModule

_PROMPTS = 2  # one group per optimizer step with the default options: 2 steps
_GENERATIONS = 4


@pytest.mark.timeout(300)
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_user_checkpoint_of_every_family_fits_with_default_options(family, lora, tmp_path, no_leaked_processes):
    """With `lora`, LoRA on every linear layer (fused projections included): the generator gets the merged weights
    at every push, and only the adapters train."""
    folder = save_zoo_model(family, tmp_path / family)
    datamodule = GRPODataModule(
        model=str(folder),
        dataset=tiny_prompts(_PROMPTS),
        reward_funcs=[char_sum_reward],
        num_generations=_GENERATIONS,
        max_completion_length=8,
    )
    trainer = cpu_trainer(default_root_dir=tmp_path)
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear") if lora else None
    module = GRPOModule(str(folder), learning_rate=1e-3, peft_config=peft_config)
    trainer.fit(module, datamodule=datamodule)

    progress = datamodule.progress
    # every group consumed; the character-sum reward gives each group a learning signal, so none is dropped
    assert (progress.trained_total, dict(progress.dropped)) == (_PROMPTS, {}), family
    assert trainer.global_step == _PROMPTS
    if lora:
        adapters = [name for name, p in module.policy.named_parameters() if p.requires_grad]
        assert adapters and all("lora_" in name for name in adapters), adapters[:4]
        merged = module.policy.merge_and_unload().state_dict()
    else:
        merged = module.policy.state_dict()
    loaded = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    changed = [name for name, value in loaded.items() if not torch.equal(value, merged[name])]
    assert changed, f"{family}: no weight changed by {trainer.global_step} steps"
