"""The tiny model in tests: a tiny `Trainer.fit` (prompts, a reward with a learning signal, the data module, a CPU
trainer), and builders for packed micro-batches (TRL `TreeRow.pack()` plus the keys of
`lightning_grpo.pipeline.batch`) with the unpacked per-sample reference computations the packed ones are checked
against."""

from __future__ import annotations

from collections.abc import Sequence

import lightning.pytorch as pl
import numpy as np
import torch
from datasets import Dataset
from trl.experimental.async_grpo.packing import TreeRow

from helpers.fit_rewards import char_sum_reward
from lightning_grpo.datamodule import GRPODataModule


def sample(
    prompt: Sequence[int],
    completion: Sequence[int],
    *,
    group_id: int = 0,
    advantage: float = float("nan"),
    uid: int = 0,
    truncated: bool = False,
    rewards: Sequence[float] = (),
    seed: int = 0,
) -> dict:
    """A TreeRow sample dict: the completion is trained, old logprobs are random negatives."""
    ids = np.array([*prompt, *completion], dtype=np.int64)
    mask = np.array([0] * len(prompt) + [1] * len(completion), dtype=np.int64)
    old = -np.random.default_rng(seed).uniform(0.5, 5.0, size=ids.size).astype(np.float32) * mask
    return {
        "input_ids": ids,
        "completion_mask": mask,
        "old_log_probs": old,
        "advantage": advantage,
        "group_id": group_id,
        "uid": uid,
        "truncated": truncated,
        "rewards": list(rewards),
    }


def micro_batch(samples: list[dict], num_reward_columns: int | None = None) -> dict[str, torch.Tensor]:
    """One rank's packed row with the per-sample keys of `lightning_grpo.pipeline.batch` (`step_trained_tokens` = this row)."""
    row = TreeRow()
    for s in samples:
        row.add(s)
    mb = row.pack()
    columns = num_reward_columns if num_reward_columns is not None else len(samples[0]["rewards"])
    rewards = [s["rewards"] if s["rewards"] else [float("nan")] * columns for s in samples]
    mb["sample_uid"] = torch.tensor([s["uid"] for s in samples], dtype=torch.long)
    mb["sample_group_id"] = torch.tensor([s["group_id"] for s in samples], dtype=torch.long)
    mb["sample_truncated"] = torch.tensor([s["truncated"] for s in samples], dtype=torch.bool)
    mb["sample_trained_tokens"] = torch.tensor([int(s["completion_mask"].sum()) for s in samples], dtype=torch.long)
    mb["rollout_rewards"] = torch.tensor(rewards, dtype=torch.float32).reshape(len(samples), columns)
    mb["step_trained_tokens"] = torch.tensor(float(mb["token_index"].numel()))
    return mb


def set_step_tokens(batches: list[list[dict]]) -> None:
    """Set `step_trained_tokens` of every micro-batch of every rank to the step's total."""
    total = float(sum(mb["token_index"].numel() for rank in batches for mb in rank))
    for rank in batches:
        for mb in rank:
            mb["step_trained_tokens"] = torch.tensor(total)


def reference_logprobs(model, samples: list[dict], temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample unpacked forwards: logprobs and entropies of every trained token, samples in order."""
    logprobs, entropies = [], []
    for s in samples:
        ids = torch.from_numpy(s["input_ids"])[None]
        logits = model(input_ids=ids).logits[0, :-1].float() / temperature
        logp = torch.log_softmax(logits, dim=-1)
        trained = torch.from_numpy(s["completion_mask"][1:]).bool()
        logprobs.append(logp[trained].gather(1, ids[0, 1:][trained][:, None]).squeeze(1))
        entropies.append(-(logp.exp() * logp).sum(-1)[trained])
    return torch.cat(logprobs), torch.cat(entropies)


def shared_prompt_group(
    prompt_len: int,
    completion_lens: Sequence[int],
    *,
    group_id: int = 0,
    uid0: int = 0,
    seed: int = 0,
    vocab: int = 100,
) -> list[dict]:
    """Samples sharing one random prompt; completions share random prefixes, so the trie forks inside them too."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(4, vocab, size=prompt_len).tolist()
    base = rng.integers(4, vocab, size=max(completion_lens)).tolist()
    samples = []
    for k, n in enumerate(completion_lens):
        fork = int(rng.integers(0, n + 1))  # shares `fork` tokens with `base`, then diverges
        tail = rng.integers(4, vocab, size=n - fork).tolist()
        completion = base[:fork] + tail
        samples.append(sample(prompt, completion, group_id=group_id, uid=uid0 + k, seed=seed * 1000 + k))
    return samples


def rollout_group(
    group_id: int,
    prompt_len: int,
    completion_lens: Sequence[int],
    *,
    seed: int = 0,
    rewards: Sequence[float] | None = None,
    reward_name: str = "accuracy",
    advantage: float = float("nan"),
    truncated: Sequence[bool] = (),
    payload: dict | None = None,
    vocab: int = 100,
):
    """A group of `RolloutSample`s sharing a random prompt, as the rollout loop sends them (pending by default)."""
    from lightning_grpo.rollout.records import SCORE_PAYLOAD, RolloutSample

    rng = np.random.default_rng(seed)
    prompt = rng.integers(4, vocab, size=prompt_len)
    samples = []
    for k, n in enumerate(completion_lens):
        ids = np.concatenate([prompt, rng.integers(4, vocab, size=n)]).astype(np.int64)
        mask = np.array([0] * prompt_len + [1] * n, dtype=np.int64)
        metrics = {f"rewards/{reward_name}": float(rewards[k])} if rewards is not None else {}
        extras = {SCORE_PAYLOAD: {"rows": len(completion_lens), "columns": [], "payload": payload or {}}}
        samples.append(
            RolloutSample(
                prompt="p",
                completion="c",
                input_ids=ids,
                completion_mask=mask,
                old_log_probs=(-rng.uniform(0.5, 3.0, size=ids.size) * mask).astype(np.float32),
                advantage=advantage,
                model_version=0,
                group_id=group_id,
                metrics=metrics,
                truncated=bool(truncated[k]) if truncated else False,
                group_rows=len(completion_lens),
                extras=extras,
            )
        )
    return samples


def plan_step(
    groups: list, *, num_processes: int, steps: int, token_budget: int = 0, samples_per_row: int = 4, scorers=()
):
    """The first `StepPlan` the real `StepPlanner` makes of `groups`."""
    from lightning_grpo.pipeline.planner import StepPlanner

    planner = StepPlanner(
        groups,
        num_processes=num_processes,
        steps=steps,
        token_budget=token_budget,
        samples_per_row=samples_per_row,
        scorers=list(scorers),
    )
    return next(iter(planner))


def collate_step(plan, scorers, *, num_processes: int, reward_names=(), progress=None) -> list:
    """One `StepBatch` per rank: the real `ProgressCollator`'s packing plus each scorer's inputs under `s{index}_`."""
    from lightning_grpo.pipeline.collating import ProgressCollator

    batches = ProgressCollator(progress, num_processes=num_processes, reward_names=reward_names)(plan)
    for m, rows in enumerate(plan.micro_batches):
        for index, scorer in enumerate(scorers):
            inputs, _ = scorer.collate(rows, index)
            for rank, row_inputs in enumerate(inputs):
                batches[rank].micro_batches[m].update({f"s{index}_{k}": v for k, v in row_inputs.items()})
    return batches


def one_process_plan(plan):
    """The same step laid out for one rank: every row of the plan is its own micro-batch."""
    from lightning_grpo.pipeline.planner import StepPlan

    return StepPlan([[row] for row in plan.rows], plan.samples, plan.group_ids, plan.pending_group_ids, plan.metrics)


def tiny_reward_model(seed: int = 0, constant: bool = False):
    """A tiny random `LlamaForSequenceClassification` (one label); `constant=True` zeroes its head (reward 0)."""
    from transformers import LlamaForSequenceClassification

    from lightning_grpo.models import tiny_llama_config

    config = tiny_llama_config()
    config.num_labels = 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForSequenceClassification(config)
    if constant:
        torch.nn.init.zeros_(model.score.weight)
    return model.eval()


def run_score_step_rank(rank: int, world_size: int, workdir: str) -> None:
    """One gloo rank of a multi-process `score_step` test (run in its own process): reads `batches.pkl` and
    `kwargs.pkl` from `workdir`, scores its `StepBatch` and pickles what it got to `rank{rank}.pkl`."""
    import pickle
    from datetime import timedelta

    import torch.distributed as dist

    from lightning_grpo.scoring.builtin_scorers import RewardModelScorer
    from lightning_grpo.scoring.step import score_step

    torch.set_num_threads(1)
    with open(f"{workdir}/batches.pkl", "rb") as f:
        batches, kwargs = pickle.load(f)
    dist.init_process_group(
        "gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
    )
    try:
        scorers = [RewardModelScorer(tiny_reward_model(0), name="rm")]
        result = score_step(torch.nn.Linear(1, 1), batches[rank], scorers=scorers, **kwargs)
        with open(f"{workdir}/rank{rank}.pkl", "wb") as f:
            pickle.dump({"result": result, "micro_batches": batches[rank].micro_batches}, f)
    finally:
        dist.destroy_process_group()


def tiny_prompts(n: int, length: int = 0) -> Dataset:
    """`n` chat prompts "Say {i}.", each padded with `length` more characters."""
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Say {i}." + "x" * length}] for i in range(n)]})


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
