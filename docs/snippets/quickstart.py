"""The home page's example: GRPO on the builtin arithmetic task, rewarded by accuracy and a function written here.

Run by tests/docs/test_results_pages.py (on the tiny model, for two steps), so the page shows code that works.
"""

import lightning.pytorch as pl

from lightning_grpo import GRPODataModule, GRPOModule


def brevity(completions, **columns):
    """TRL's reward signature: one float per completion (None: not scored)."""
    return [1.0 / (1 + len(c[-1]["content"])) for c in completions]


if __name__ == "__main__":  # the rollout process re-imports this file
    datamodule = GRPODataModule(
        dataset="arithmetic",  # or .jsonl/.parquet, a Dataset, a Hub name
        reward_funcs=["lightning_grpo.rewards.accuracy", brevity],
        num_generations=8,  # completions per prompt: one group
        max_completion_length=64,
        temperature=0.7,
    )
    module = GRPOModule("smollm2-135m-instruct", learning_rate=2e-5)
    trainer = pl.Trainer(max_epochs=-1)  # the data module ends the run
    trainer.fit(module, datamodule=datamodule)
