"""A tiny `Trainer.fit` in tests: prompts, a reward with a learning signal, the data module and a CPU trainer."""

from __future__ import annotations

import lightning.pytorch as pl
from datasets import Dataset
from fit_rewards import char_sum_reward

from lightning_grpo.datamodule import GRPODataModule

__all__ = ["char_sum_reward", "cpu_trainer", "tiny_datamodule", "tiny_prompts"]


def tiny_prompts(n: int) -> Dataset:
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Say {i}."}] for i in range(n)]})


def tiny_datamodule(prompts: int, **overrides) -> GRPODataModule:
    options = dict(
        model="tiny-random",
        dataset=tiny_prompts(prompts),
        reward_funcs=[char_sum_reward],
        num_generations=4,
        max_completion_length=8,
        samples_per_row=4,
    )
    return GRPODataModule(**(options | overrides))


def cpu_trainer(**overrides) -> pl.Trainer:
    """A CPU trainer that lets the data module end the run (`max_epochs=-1`)."""
    options = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    return pl.Trainer(**(options | overrides))
