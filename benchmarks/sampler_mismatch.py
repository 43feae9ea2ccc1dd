"""How far the embedded generator's log-probabilities are from the trainer's, per generator precision: the mismatch
the loss's ratio and `vllm_importance_sampling_correction` see.

Each generator configuration (`--configs`: `bf16`, the default on a CPU with bf16 products; `int8`, the same with
`quantization="int8"`; `fp32`) samples the same completions' worth of prompts (the builtin arithmetic prompts
through the model's chat template, `--samples` completions each, at the main job's temperature). The trainer then
scores each completion teacher-forced, as its loss does: fp32 weights under bf16 autocast (`bf16-mixed`, what
`AutoPrecision` picks where bf16 is faster) and in fp32 (`32-true`). Reported per pair: the sampled tokens' mean and
99th-percentile |trainer - generator| log-probability, its mean (a bias), and the importance weights the correction
would apply, exp(trainer - generator), per token (5th and 95th percentiles) and per completion (the sequence
weight of the default `sequence_mask` mode: 5th and 95th percentiles).

    python benchmarks/sampler_mismatch.py                     # SmolLM2, bf16 and int8 (where the CPU has AMX-INT8)
    python benchmarks/sampler_mismatch.py --configs bf16 int8 fp32 --prompts 32
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
from pathlib import Path

import common  # noqa: I001  (first: sets the offline environment before torch and TRL load)
import torch  # noqa: E402

from lightning_grpo.data.arithmetic import arithmetic_dataset  # noqa: E402
from lightning_grpo.models import load_policy, load_tokenizer  # noqa: E402
from lightning_grpo.rollout.generator import EmbeddedGenerator  # noqa: E402
from lightning_grpo.rollout.sampling import teacher_forced_logprobs  # noqa: E402

#: Generator configurations: (dtype, quantization).
CONFIGS = {"bf16": (torch.bfloat16, None), "int8": (torch.bfloat16, "int8"), "fp32": (torch.float32, None)}
#: The trainer's precisions: whether its forward runs under bf16 autocast.
TRAINERS = {"bf16-mixed": True, "32-true": False}


def sample(policy, dtype, quantization, prompts, samples: int, max_tokens: int, temperature: float):
    """Every prompt's `samples` completions from an embedded generator on a copy of `policy` in `dtype`."""
    model = copy.deepcopy(policy).to(dtype)
    with EmbeddedGenerator(
        model, max_tokens=max_tokens, temperature=temperature, seed=0, quantization=quantization, max_batch_size=64
    ) as generator:

        async def run():
            return await asyncio.gather(*(generator.generate(p) for p in prompts for _ in range(samples)))

        outputs = asyncio.run(run())
    return [(p, o) for p, o in zip([p for p in prompts for _ in range(samples)], outputs, strict=True)]


def mismatch(policy, pairs, autocast: bool, temperature: float) -> dict[str, float]:
    """The trainer's teacher-forced log-probabilities of the sampled tokens against the generator's."""
    per_token, per_sequence = [], []
    for prompt, output in pairs:
        if not output.token_ids:
            continue
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            trainer = teacher_forced_logprobs(policy, prompt, output.token_ids, temperature=temperature).float()
        difference = trainer - torch.tensor(output.logprobs)
        per_token.append(difference)
        per_sequence.append(difference.sum())
    tokens, sequences = torch.cat(per_token), torch.stack(per_sequence)
    token_weights, sequence_weights = tokens.exp(), sequences.exp()
    return {
        "tokens": tokens.numel(),
        "mean_abs": tokens.abs().mean().item(),
        "p99_abs": tokens.abs().quantile(0.99).item(),
        "mean": tokens.mean().item(),
        "token_weight_p5": token_weights.quantile(0.05).item(),
        "token_weight_p95": token_weights.quantile(0.95).item(),
        "sequence_weight_p5": sequence_weights.quantile(0.05).item(),
        "sequence_weight_p95": sequence_weights.quantile(0.95).item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", choices=list(common.MODELS))
    parser.add_argument("--configs", nargs="+", default=["bf16", "int8"], choices=list(CONFIGS))
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    name = common.MODELS[args.model]
    print(f"commit {common.git_commit()} | {common.machine()} | {name}, {args.prompts} prompts x {args.samples}")
    policy = load_policy(name, torch.float32).eval()
    tokenizer = load_tokenizer(name)
    prompts = [
        list(tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, return_dict=False))
        for row in arithmetic_dataset(args.prompts, seed=0)
    ]
    print(f"{'generator':<10}{'trainer':<12}{'tokens':>8}{'mean|d|':>10}{'p99|d|':>9}{'mean d':>9}"
          f"{'token w p5-p95':>18}{'seq w p5-p95':>16}")  # fmt: skip
    results = {}
    for config in args.configs:
        dtype, quantization = CONFIGS[config]
        pairs = sample(policy, dtype, quantization, prompts, args.samples, args.max_tokens, args.temperature)
        for trainer, autocast in TRAINERS.items():
            row = results[f"{config} / {trainer}"] = mismatch(policy, pairs, autocast, args.temperature)
            print(
                f"{config:<10}{trainer:<12}{row['tokens']:>8}{row['mean_abs']:>10.4f}{row['p99_abs']:>9.3f}"
                f"{row['mean']:>9.4f}{row['token_weight_p5']:>9.3f}-{row['token_weight_p95']:.3f}"
                f"{row['sequence_weight_p5']:>10.3f}-{row['sequence_weight_p95']:.3f}",
                flush=True,
            )
    if args.out:
        command = "python benchmarks/sampler_mismatch.py " + " ".join(f"--configs {' '.join(args.configs)}".split())
        args.out.write_text(json.dumps({"provenance": common.provenance(command), "results": results}, indent=2))


if __name__ == "__main__":
    main()
