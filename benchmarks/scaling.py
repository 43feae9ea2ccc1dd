"""How cost grows with the work: seconds per step and peak memory over policy size, completion length and group
size, full fine-tuning against LoRA, with and without gradient checkpointing.

Policies: SmolLM2-135M-Instruct (its real weights) and random-weight models built from the public configurations of
SmolLM2-360M, Qwen2.5-0.5B and Qwen2.5-1.5B (`POLICIES`: the same code path and the real shapes, vocabularies
included; random weights never emit EOS, so every completion runs to its full length). Every measurement runs in a
fresh process whose peak resident memory (sampled with its children) is its own, under an address-space limit of
what this machine has available (`--memory-gib`), so a configuration that does not fit fails with an allocation
error instead of swapping or waking the OOM killer; the table says "does not fit".

- trainer: `warmup + steps` GRPO optimizer steps as `GRPOModule.training_step` runs them (`benchmarks/lora.py`'s
  `timed_steps`: tree-packed micro-batches of at most `--row-samples` samples, the GRPO loss, clipping, AdamW) in the
  precision `AutoPrecision` chooses here, `--train-threads` threads; the median step after the warm-up;
- rollout process: the embedded generator in the dtype `generator_dtype="auto"` chooses here, on `--gen-threads`
  threads, sampling the same step's completions (the groups' prompts prefilled once each, up to 64 in flight): its
  seconds for the step's tokens and its peak memory (weights and KV cache), once per shape (the training mode does
  not change it);
- an asynchronous step takes about the larger of the two when each has its own cores, as `trainer_threads="auto"`
  splits them (the rollout child's 1 core beside the trainer's 1 on 2 cores).

Sweeps: policy x {full, LoRA} x {checkpointing off, on} at the base shape (`--groups` groups of `--group-size`,
`--length`-token completions after a 48-token prompt); then on `--sweep-policy`, completion length (`--lengths`) and
group size (`--group-sizes`), full fine-tuning without checkpointing (with it where that does not fit). Prints
markdown tables and writes `scaling.json` and `scaling.png` under `--out`; the README's "largest model that fits"
line comes from the first table: trainer peak + rollout peak under this machine's memory.

    python benchmarks/scaling.py                                         # everything (about an hour on 2 cores)
    python benchmarks/scaling.py --policies smollm2-135m qwen2.5-0.5b --skip-sweeps
    python benchmarks/scaling.py --policies tiny --sweep-policy tiny --lengths 16 32 --group-sizes 4 8 --steps 1
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import common  # noqa: I001  (first: sets the offline environment before torch and TRL load)
import torch  # noqa: E402
from lora import TrainConfig, packed_micro_batches, timed_steps  # noqa: E402

from lightning_grpo.cli.main_job import _PeakMemory  # noqa: E402  (the whole-tree peak memory)

PROMPT = 48
#: The public configurations (`config.json` on the Hub) of the policies built with random weights; `smollm2-135m`
#: is the real model and `tiny` the in-code test model.
POLICIES: dict[str, dict[str, Any]] = {
    "tiny": {"load": "tiny-random"},
    "smollm2-135m": {"load": "smollm2-135m-instruct"},
    "smollm2-360m": {
        "model_type": "llama", "hidden_size": 960, "intermediate_size": 2560, "num_hidden_layers": 32,
        "num_attention_heads": 15, "num_key_value_heads": 5, "vocab_size": 49152, "max_position_embeddings": 8192,
        "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
    },
    "qwen2.5-0.5b": {
        "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
        "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    },
    "qwen2.5-1.5b": {
        "model_type": "qwen2", "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
        "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    },
}  # fmt: skip
MODES = {"full": (False, False), "full + ckpt": (False, True), "LoRA": (True, False), "LoRA + ckpt": (True, True)}


def build_policy(name: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """`POLICIES[name]`: the real model, or random weights (seed 0) in its public configuration."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_grpo.models import load_policy

    spec = dict(POLICIES[name])
    if "load" in spec:
        return load_policy(spec["load"], dtype=dtype)
    torch.manual_seed(0)
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


# -- the two workers, each in its own process -------------------------------------------------------------------------


def trainer_worker(job: dict[str, Any]) -> dict[str, Any]:
    """One configuration's optimizer steps (see the module docstring)."""
    from lightning_grpo.training.precision_plugin import choose_precision

    torch.set_num_threads(job["threads"])
    precision = choose_precision("cpu")[0]
    config = TrainConfig(lora=job["lora"], checkpointing=job["checkpointing"], precision=precision)
    length = job["length"]

    def batches(vocab: int) -> list[dict[str, torch.Tensor]]:
        return packed_micro_batches(job["groups"], vocab, group_size=job["group_size"], prompt=PROMPT,
                                    completions=(length, length), row_samples=job["row_samples"])  # fmt: skip

    result = timed_steps(build_policy(job["policy"]), config, batches, job["warmup"], job["steps"])
    return {"seconds": statistics.median(result["step_s"]), "trainable": result["trainable"], "precision": precision}


def rollout_worker(job: dict[str, Any]) -> dict[str, Any]:
    """The embedded generator sampling one step's completions (see the module docstring)."""
    import asyncio

    from lightning_grpo.models.dtype_probe import resolve_generator_dtype
    from lightning_grpo.rollout.decode_linears import decode_product
    from lightning_grpo.rollout.generator import EmbeddedGenerator

    dtype, _ = resolve_generator_dtype("auto", torch.float32, decode_product)
    policy = build_policy(job["policy"], dtype=getattr(torch, dtype))
    generator = EmbeddedGenerator(policy, eos_token_ids=[], max_batch_size=64, num_threads=job["threads"], seed=0)
    prompts = torch.randint(
        4, policy.config.vocab_size, (job["groups"], PROMPT), generator=torch.Generator().manual_seed(0)
    )

    async def one_step() -> int:
        requests = [generator.generate(p, job["length"]) for p in prompts.tolist() for _ in range(job["group_size"])]
        return sum(len(output.token_ids) for output in await asyncio.gather(*requests))

    try:
        asyncio.run(one_step_warmup(generator, prompts[0].tolist()))
        started = time.perf_counter()
        tokens = asyncio.run(one_step())
        seconds = time.perf_counter() - started
    finally:
        generator.close()
    return {"seconds": seconds, "tokens": tokens, "dtype": dtype}


async def one_step_warmup(generator: Any, prompt: list[int]) -> None:
    """A short request first, so the step's time has no one-off start-up in it."""
    await generator.generate(prompt, 2)


def run_worker(kind: str, job: dict[str, Any], memory_gib: float) -> dict[str, Any]:
    """`kind`'s worker on `job` in a fresh process; its result with `peak_gib`, or `{"fits": False, ...}` when it ran
    out of the memory it may use."""
    command = [sys.executable, __file__, "--worker", kind, json.dumps(job), "--memory-gib", str(memory_gib)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    memory = _PeakMemory(interval_s=0.1, pid=process.pid)
    out, err = process.communicate()
    peak = memory.stop()
    if process.returncode != 0:
        out_of_memory = any(text in err for text in ("can't allocate memory", "MemoryError", "Cannot allocate"))
        if not out_of_memory:
            raise RuntimeError(f"{kind} worker failed on {job}: {err[-2000:]}")
        return {"fits": False, "peak_gib": peak}
    return {"fits": True, "peak_gib": peak, **json.loads(out.strip().splitlines()[-1])}


def _limit_memory(gib: float) -> None:
    """Cap this process's address space, so an allocation past it fails here instead of exhausting the machine."""
    limit = int(gib * 1024**3)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


# -- the sweeps -------------------------------------------------------------------------------------------------------


def measure(args: argparse.Namespace, policy: str, mode: str, groups: int, group_size: int, length: int) -> dict:
    """The trainer and the rollout process on one configuration; the async step's estimate; what fits."""
    lora, checkpointing = MODES[mode]
    shape = {"policy": policy, "groups": groups, "group_size": group_size, "length": length}
    trainer = run_worker("trainer", {**shape, "lora": lora, "checkpointing": checkpointing, "threads": args.train_threads,
                                     "row_samples": args.row_samples, "warmup": args.warmup, "steps": args.steps},
                         args.memory_gib)  # fmt: skip
    rollout = _rollout(args, tuple(shape.items()))
    fits = trainer["fits"] and rollout["fits"] and trainer["peak_gib"] + rollout["peak_gib"] <= args.memory_gib
    step = max(trainer.get("seconds", float("inf")), rollout.get("seconds", float("inf")))
    return {**shape, "mode": mode, "trainer": trainer, "rollout": rollout, "fits": fits, "async_step_s": step}


_ROLLOUTS: dict[tuple, dict[str, Any]] = {}


def _rollout(args: argparse.Namespace, shape: tuple) -> dict[str, Any]:
    """The rollout process on `shape` (the same for every training mode: measured once)."""
    if shape not in _ROLLOUTS:
        _ROLLOUTS[shape] = run_worker("rollout", {**dict(shape), "threads": args.gen_threads}, args.memory_gib)
    return _ROLLOUTS[shape]


def print_row(row: dict[str, Any]) -> None:
    trainer, rollout = row["trainer"], row["rollout"]
    cells = [
        row["policy"], row["mode"], f"{row['groups']}x{row['group_size']}", str(row["length"]),
        _seconds(trainer), f"{trainer['peak_gib']:.1f}", _seconds(rollout), f"{rollout['peak_gib']:.1f}",
        f"{trainer['peak_gib'] + rollout['peak_gib']:.1f}", "yes" if row["fits"] else "**no**",
    ]  # fmt: skip
    print("| " + " | ".join(cells) + " |", flush=True)


def _seconds(side: dict[str, Any]) -> str:
    return f"{side['seconds']:.1f}" if side["fits"] else "does not fit"


HEADER = (
    "| policy | mode | groups x size | tokens | trainer s/step | trainer GiB | rollout s/step | rollout GiB | both GiB "
    "| fits |\n|---|---|---|---|---|---|---|---|---|---|"
)


def sweep(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    print(f"\n## policy size x mode ({args.groups} groups of {args.group_size}, {args.length} tokens)\n\n{HEADER}")
    for policy in args.policies:
        for mode in args.modes:
            rows.append(measure(args, policy, mode, args.groups, args.group_size, args.length))
            print_row(rows[-1])
    if args.skip_sweeps:
        return rows
    print(f"\n## completion length ({args.sweep_policy}, {args.groups} groups of {args.group_size})\n\n{HEADER}")
    for length in args.lengths:
        rows.append(measure(args, args.sweep_policy, _fitting_mode(args, rows, length), args.groups, args.group_size,
                            length))  # fmt: skip
        print_row(rows[-1])
    print(f"\n## group size ({args.sweep_policy}, {args.groups} groups, {args.length} tokens)\n\n{HEADER}")
    for size in args.group_sizes:
        rows.append(measure(args, args.sweep_policy, "full", args.groups, size, args.length))
        print_row(rows[-1])
    return rows


def _fitting_mode(args: argparse.Namespace, rows: list[dict[str, Any]], length: int) -> str:
    """Full fine-tuning, with checkpointing once a shorter length needed more than half the memory without it."""
    earlier = [row for row in rows if row["policy"] == args.sweep_policy and row["mode"] == "full"]
    heavy = any(row["trainer"]["peak_gib"] > args.memory_gib / 2 and row["length"] < length for row in earlier)
    return "full + ckpt" if heavy else "full"


def largest_fitting(rows: list[dict[str, Any]], policies: list[str]) -> dict[str, str | None]:
    """Per mode, the largest of `policies` (in their order) whose trainer and rollout process fit together."""
    largest: dict[str, str | None] = {}
    for row in rows:
        if row["policy"] in policies and row["fits"]:
            current = largest.get(row["mode"])
            if current is None or policies.index(row["policy"]) > policies.index(current):
                largest[row["mode"]] = row["policy"]
    return largest


def plot(rows: list[dict[str, Any]], policies: list[str], path: Path) -> None:
    """Seconds per step and peak memory by policy, one line per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    first: dict[tuple[str, str], dict[str, Any]] = {}  # the policy table's rows (a sweep may repeat its shape)
    shape = (rows[0]["length"], rows[0]["group_size"])
    for row in rows:
        if row["policy"] in policies and (row["length"], row["group_size"]) == shape:
            first.setdefault((row["policy"], row["mode"]), row)
    base = list(first.values())
    for mode in dict.fromkeys(row["mode"] for row in base):
        points = [row for row in base if row["mode"] == mode and row["fits"]]
        names = [policies.index(row["policy"]) for row in points]
        left.plot(names, [row["async_step_s"] for row in points], "o-", label=mode)
        right.plot(names, [row["trainer"]["peak_gib"] + row["rollout"]["peak_gib"] for row in points], "o-", label=mode)
    for ax, label in (
        (left, "async step, s (max of trainer, rollout)"),
        (right, "peak memory, trainer + rollout, GiB"),
    ):
        ax.set_xticks(range(len(policies)), policies, rotation=20)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parser() -> argparse.ArgumentParser:
    available = _available_gib()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", nargs="+", choices=list(POLICIES), default=[n for n in POLICIES if n != "tiny"])
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--groups", type=int, default=2, help="prompt groups per step")
    p.add_argument("--group-size", type=int, default=8, help="completions per prompt")
    p.add_argument("--length", type=int, default=128, help="completion tokens")
    p.add_argument("--row-samples", type=int, default=8, help="samples per micro-batch (GRPODataModule's rows)")
    p.add_argument("--sweep-policy", default="smollm2-135m", choices=list(POLICIES))
    p.add_argument("--lengths", nargs="+", type=int, default=[64, 256, 1024])
    p.add_argument("--group-sizes", nargs="+", type=int, default=[4, 8, 16, 32])
    p.add_argument("--skip-sweeps", action="store_true", help="only the policy x mode table")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=1, help="timed steps (the median) after the warm-up")
    p.add_argument("--train-threads", type=int, default=1, help="the trainer's share of a 2-core machine")
    p.add_argument("--gen-threads", type=int, default=1, help="the rollout child's share")
    p.add_argument("--memory-gib", type=float, default=available, help=f"memory a run may use ({available:.1f})")
    p.add_argument("--out", default="runs/scaling")
    p.add_argument("--worker", nargs=2, default=None, help=argparse.SUPPRESS)  # KIND JOB_JSON, in a fresh process
    return p


def _available_gib() -> float:
    import psutil

    return round(psutil.virtual_memory().available / 1024**3 - 1.0, 1)  # a GiB left for the system


def main() -> None:
    args = parser().parse_args()
    if args.worker is not None:
        _limit_memory(args.memory_gib)
        kind, job = args.worker
        worker = trainer_worker if kind == "trainer" else rollout_worker
        print(json.dumps(worker(json.loads(job))))
        return
    print(f"# scaling: commit {common.git_commit()}, {common.machine()}, torch {torch.__version__}, "
          f"trainer {args.train_threads} thread(s), rollout {args.gen_threads}, {args.memory_gib:.1f} GiB usable")  # fmt: skip
    rows = sweep(args)
    largest = largest_fitting(rows, args.policies)
    print("\nlargest policy that fits (trainer + rollout process), per mode: "
          + ", ".join(f"{mode}: {name or 'none'}" for mode, name in largest.items()))  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = common.provenance("python benchmarks/scaling.py " + " ".join(sys.argv[1:]))
    report = {"provenance": command, "rows": rows, "largest": largest, "args": vars(args)}
    (out / "scaling.json").write_text(json.dumps(report, indent=2))
    plot(rows, args.policies, out / "scaling.png")
    print(f"wrote {out / 'scaling.json'} and {out / 'scaling.png'}")


if __name__ == "__main__":
    main()
