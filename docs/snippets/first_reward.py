"""Your first reward: GRPO on the tiny random Llama with a reward written here
(docs/get-started/first-reward.md).

Run by tests/docs/test_docs_site.py, so the page shows code that works.
"""

import lightning.pytorch as pl
import pandas as pd
from lightning.pytorch.loggers import CSVLogger

from lightning_grpo import GRPODataModule, GRPOModule
from lightning_grpo.callbacks import CompletionsTableCallback


def digit_fraction(completions, **columns):
    """TRL's reward signature: one float per completion (None: not scored).

    Dataset columns arrive by name.
    """
    texts = [completion[-1]["content"] for completion in completions]
    return [sum(ch.isdigit() for ch in text) / max(len(text), 1) for text in texts]


# the rollout child re-imports this file; only the parent trains
if __name__ == "__main__":
    # the reward of three chat completions (each a list of messages)
    samples = ["The answer is 42.", "42", "forty-two"]
    rewards = digit_fraction([[{"role": "assistant", "content": s}] for s in samples])
    print("rewards:", [round(reward, 3) for reward in rewards])

    datamodule = GRPODataModule(
        # or a .jsonl/.parquet path, a datasets.Dataset, a Hub dataset name
        dataset="arithmetic",
        dataset_size=8,
        # callables or import paths, e.g. "lightning_grpo.rewards.accuracy"
        reward_funcs=[digit_fraction],
        num_generations=4,  # completions per prompt: one group
        max_completion_length=8,
        samples_per_row=8,  # two groups per optimizer step
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        # the data module ends the run once every prompt group is consumed
        max_epochs=-1,
        log_every_n_steps=1,
        logger=CSVLogger("logs", name="first_reward"),
        callbacks=[CompletionsTableCallback(log_completions_every_n_steps=1)],
        enable_checkpointing=False,
        limit_val_batches=0,
    )
    trainer.fit(GRPOModule("tiny-random", learning_rate=2e-2), datamodule=datamodule)

    metrics = pd.read_csv(f"{trainer.logger.log_dir}/metrics.csv")
    metrics = metrics.dropna(subset=["reward"])
    print(metrics[["step", "reward", "reward_std", "loss"]].to_string(index=False))
    table = pd.read_csv(f"{trainer.logger.log_dir}/completions.csv")
    columns = ["step", "prompt", "completion", "reward", "advantage"]
    print(table[columns].head(4).to_string(index=False))
