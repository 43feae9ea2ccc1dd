"""Validation: `num_generations_eval` completions per held-out prompt, rewards weighted as in training, pass@k and
mean@k equal to a brute-force count, NaN kept as "not scored"; and a raw-text dataset that trains and validates the
tiny model without a chat template (a real `Trainer.fit`, its rollout child and reward pools)."""

from __future__ import annotations

import functools
import math

import numpy as np
import pandas as pd
import pytest
import torch
from datasets import Dataset
from helpers.fit_rewards import scripted_reward
from helpers.tiny import cpu_trainer, tiny_datamodule
from lightning.pytorch import Callback
from lightning.pytorch.loggers import CSVLogger

from lightning_grpo import GRPOModule
from lightning_grpo.models import char_tokenizer
from lightning_grpo.rollout.chat import render_prompt
from lightning_grpo.validation.metrics import ValidationTally


def brute_force(columns: np.ndarray, weights: np.ndarray, threshold: float) -> dict[str, float]:
    """The metrics counted by hand: every completion, every prompt, no shared code with `ValidationTally`."""
    prompts, scored_rewards, solved, rates = 0, [], 0, []
    for group in columns:  # (prompts, columns, k)
        rewards = []
        for completion in range(group.shape[1]):
            values = [(w, v) for w, v in zip(weights, group[:, completion], strict=True) if not math.isnan(v)]
            if values:
                rewards.append(sum(w * v for w, v in values))
        scored_rewards += rewards
        if rewards:
            prompts += 1
            solved += any(r >= threshold for r in rewards)
            rates.append(sum(r >= threshold for r in rewards) / len(rewards))
    total = columns.shape[0] * columns.shape[2]
    return {
        "reward": sum(scored_rewards) / len(scored_rewards),
        "unscored": (total - len(scored_rewards)) / total,
        "pass": solved / prompts,
        "mean": sum(rates) / prompts,
    }


def test_pass_at_k_mean_at_k_and_rewards_equal_a_brute_force_count_with_nan_never_zero():
    rng = np.random.default_rng(0)
    k, weights, threshold = 4, np.array([1.0, 0.5]), 1.0
    columns = rng.choice([0.0, 1.0, 2.0, np.nan], size=(9, 2, k), p=[0.35, 0.3, 0.1, 0.25])
    columns[0] = np.nan  # a prompt nothing scored counts for no metric
    columns[1, 0] = np.nan
    tally = ValidationTally(["a", "b"], weights, k, threshold)
    for group in columns:
        tally.add_prompt(group)
    metrics = tally.metrics()
    expected = brute_force(columns, weights, threshold)
    assert metrics["val/reward"] == pytest.approx(expected["reward"])
    assert metrics["val/unscored_frac"] == pytest.approx(expected["unscored"])
    assert metrics["val/pass@4"] == pytest.approx(expected["pass"]) and metrics["val/mean@4"] == pytest.approx(
        expected["mean"]
    )
    assert metrics["val/rewards/a"] == pytest.approx(np.nanmean(columns[:, 0]))
    # Two ranks' sums added give the metrics of all their prompts.
    halves = [ValidationTally(["a", "b"], weights, k, threshold) for _ in range(2)]
    for i, group in enumerate(columns):
        halves[i % 2].add_prompt(group)
    assert tally.metrics(halves[0].tensor() + halves[1].tensor()) == pytest.approx(metrics)
    nothing = ValidationTally(["a"], [1.0], 1, 1.0)
    nothing.add_prompt(np.full((1, 1), np.nan))
    assert math.isnan(nothing.metrics()["val/reward"]) and nothing.metrics()["val/unscored_frac"] == 1.0


class TrainedPrompts(Callback):
    """The context before the first trained token of every trained sample."""

    def __init__(self) -> None:
        self.prompts: list[tuple[int, ...]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.prompts += [tuple(s.input_ids[: int(s.completion_mask.argmax())].tolist()) for s in batch.samples]


@pytest.mark.timeout(300)
def test_a_raw_text_dataset_trains_without_a_chat_template_and_validates_pass_at_k_with_nan_unscored(
    tmp_path, no_leaked_processes
):
    tokenizer = char_tokenizer()
    tokenizer.chat_template = None  # a base model's tokenizer
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    train = Dataset.from_dict({"prompt": [f"Say {i}:" for i in range(4)]})
    held_out = Dataset.from_dict({"prompt": [f"Count {i}:" for i in range(3)], "split": ["val"] * 3})
    reward = functools.partial(scripted_reward, log_dir=str(tmp_path))
    functools.update_wrapper(reward, scripted_reward)
    # 8 completions a group: with scripted_reward's NaN, 1 or 0, a group of 4 gets no learning signal 38% of the time
    # and all 4 groups (a stall) 2%; with 8, 8% and 4e-5
    datamodule = tiny_datamodule(
        4, dataset=train, tokenizer=str(tmp_path / "tokenizer"), reward_funcs=[reward], val_dataset=held_out,
        val_size=3, val_batch_size=2, num_generations=8, samples_per_row=8,
    )  # fmt: skip
    module = GRPOModule("tiny-random", learning_rate=1e-3, num_generations_eval=4, val_temperature=1.0)
    samples = TrainedPrompts()
    trainer = cpu_trainer(logger=CSVLogger(tmp_path), log_every_n_steps=1, limit_val_batches=None, callbacks=[samples])
    torch.manual_seed(0)
    trainer.fit(module, datamodule=datamodule)

    assert trainer.global_step > 0  # it trained
    raw = {tuple(tokenizer(p)["input_ids"]) for p in train["prompt"]}  # the text's characters, no template
    assert samples.prompts and set(samples.prompts) <= raw
    assert {tuple(render_prompt(tokenizer, p)) for p in train["prompt"]} == raw

    scored = pd.read_json(tmp_path / "val.jsonl", lines=True)  # the end-of-fit validation, 4 per prompt
    assert len(scored) == 12 and set(scored["prompt"]) == set(held_out["prompt"])
    rewards = np.array([scored[scored["prompt"] == p]["reward"].to_numpy(dtype=float) for p in held_out["prompt"]])
    expected = brute_force(rewards[:, None, :], np.ones(1), 1.0)
    metrics = pd.read_csv(next(tmp_path.rglob("metrics.csv"))).dropna(subset=["val/reward"]).iloc[-1]
    assert metrics["val/reward"] == pytest.approx(expected["reward"])  # a mean over scored completions only
    assert expected["unscored"] > 0 and metrics["val/unscored_frac"] == pytest.approx(expected["unscored"])
    assert metrics["val/pass@4"] == pytest.approx(expected["pass"])
    assert metrics["val/mean@4"] == pytest.approx(expected["mean"])
    assert metrics["val/rewards/scripted_reward"] == pytest.approx(expected["reward"])


def test_greedy_validation_with_several_generations_is_refused():
    with pytest.raises(ValueError, match=r"num_generations_eval=4 with val_temperature=0.*val_temperature > 0"):
        GRPOModule("tiny-random", num_generations_eval=4)
    with pytest.raises(ValueError, match=r"num_generations_eval=0.*val_temperature=-1"):
        GRPOModule("tiny-random", num_generations_eval=0, val_temperature=-1)


def test_fixed_length_validation_runs_every_forward_of_every_turn_on_every_rank():
    """Under a sharded policy every rank must run the same forwards: `fixed_length` never stops at an EOS (here every
    token is one), and a rank whose conversations are done keeps generating while another rank reports some left."""
    from lightning_grpo.data.tooling import ConversationSpec
    from lightning_grpo.models import tiny_llama
    from lightning_grpo.validation.rollouts import Sampling, validation_rollouts

    policy = tiny_llama(seed=0)
    policy.generation_config.eos_token_id = list(range(100))  # a generate that stopped at an EOS would stop at once
    forwards = []
    policy.register_forward_hook(lambda *args: forwards.append(1))
    other_rank = [3, 2, 1, 0]  # conversations still running on another rank, turn by turn

    def most_active(active: int) -> int:
        return max(active, other_rank.pop(0))

    rows = [{"prompt": [{"role": "user", "content": "hi"}]}]
    spec = ConversationSpec(tokenizer=char_tokenizer())
    batch = validation_rollouts(
        policy, rows, spec, Sampling(max_tokens=5, fixed_length=True), eos_token_ids=[3], sync_active=most_active
    )
    assert len(forwards) == 3 * 5 and other_rank == []  # 3 turns (1 real, 2 to keep step), 5 forwards each
    assert batch.conversations[0].done and len(batch.conversations[0].turns) == 1


@pytest.mark.parametrize("fixed_length", [False, True], ids=["eos-or-stop", "fixed-length"])
def test_a_validation_turn_ends_at_a_stop_string_as_a_training_rollout_does(fixed_length):
    """`Sampling(stop=...)` (the data module's `stop`): the turn keeps the token that completed the string and nothing
    after it, and text that began in the prompt ("=" then "=") never matches; a fixed-length turn (a sharded policy)
    runs on, but is cut the same way."""
    from lightning_grpo.data.tooling import ConversationSpec
    from lightning_grpo.models import tiny_llama
    from lightning_grpo.validation.rollouts import Sampling, validation_rollouts

    policy, tokenizer = tiny_llama(seed=0), char_tokenizer()
    rows = [{"prompt": "12+3="}]
    spec = ConversationSpec(tokenizer=tokenizer, prompt_format="text")

    def completion(**options) -> str:
        batch = validation_rollouts(policy, rows, spec, Sampling(max_tokens=16, **options), eos_token_ids=[-1])
        return batch.completions[0]

    free = completion()
    assert len(free) == 16
    stop = free[5:7]
    expected = free[: free.index(stop) + len(stop)]
    assert completion(stop=(stop, "never"), fixed_length=fixed_length) == expected
