"""The learning race: our main job against TRL's GRPOTrainer, held-out accuracy against training seconds.

Both sides train the same policy on the same builtin arithmetic problems with the same reward and hyper-parameters,
and neither evaluates while it trains: each saves its policy every `--snapshot-every` optimizer steps (and after its
last) with its training clock paused, and afterwards one greedy evaluator scores every snapshot on the same held-out
problems. Printed: each side's held-out accuracy against training seconds, the seconds each first reaches 0.9 and
0.95 and their ratio (ours / TRL), and what each side's time went to; written: `race.json` and `race.png` (both
curves) under `--out`.

- ours: the main job, `lightning_grpo/configs/arithmetic.yaml`'s model and data options (SmolLM2-135M-Instruct,
  192 problems, `accuracy`, 8 completions, 4 prompt groups per optimizer step in 2 micro-batches, lr 2e-5 with 4
  warm-up steps then constant, T=0.7, 64 tokens, clip 0.2, one epoch, `max_staleness=1`): asynchronous, the
  embedded generator on one core beside the trainer; by default in the precision the command chooses here
  (`--precision auto`: `AutoPrecision`, and the generator's `generator_dtype="auto"`);
- TRL: `trl.GRPOTrainer` 1.16, synchronous (generate with HF `generate`, then train), `use_cpu=True`, with the same
  settings: `per_device_train_batch_size=16`, `gradient_accumulation_steps=2` (4 prompts x 8 completions per step),
  `beta=0`, `epsilon=0.2`, `loss_type="dapo"`, no gradient checkpointing (GRPOConfig turns it on by default; ours
  does not use it), `bf16` as our trainer's precision (GRPOConfig's default is bf16=True), AdamW with our exact
  warm-up schedule, torch's default threads.

The training clock starts when training starts (ours: `on_fit_start`, so it includes spawning the rollout process and
its first completions; TRL: `on_train_begin`), after the model is loaded, and stops at each snapshot while the policy
is written (the rollout process keeps generating meanwhile; the time is printed). The evaluator is greedy decoding of
the 96 held-out problems (the data module's validation set) with the embedded generator at temperature 0, scored by
`lightning_grpo.rewards.accuracy`. Each side trains in its own process, one after the other, then the snapshots are
scored; the machine should be otherwise idle.

Time breakdown. Ours, from the trainer's metrics: forward/backward (`perf/fwd_bwd_s`), waiting for rollouts
(`perf/rollout_wait_s`), weight pushes (`perf/weight_sync_s`), the rest (optimizer, collation, logging); generation
runs meanwhile in the rollout process. TRL, measured around its public methods: generation (`model.generate`),
reward scoring, the rest of `training_step` (the loss's forward and backward, tokenization), and the rest of each step
(optimizer, logging).

    python benchmarks/learning.py                  # the full race (SmolLM2; about 50-70 minutes on 2 quiet cores)
    python benchmarks/learning.py --model tiny-random --train-size 8 --val-size 8     # a check of the plumbing
    python benchmarks/learning.py --sides ours --reuse runs/learning/<earlier>        # ours again, same TRL run
    python benchmarks/learning.py --sides ours --precision 32-true --generator-dtype none --reuse <earlier>  # fp32
    python benchmarks/learning.py --summarize runs/learning/<a> runs/learning/<b> --out docs/    # several runs

How many steps a run needs to reach 0.9 varies from run to run (sampling, and for ours the asynchronous schedule's
timing), so one race is one draw: `--summarize` reads several runs' `race.json` and prints each run's times and
ratios, their median, and writes `learning_race.json` and `learning_race.png` (every run's curve) under `--out`.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import common  # noqa: I001  (first: sets the offline environment before torch and TRL load)
import torch  # noqa: E402
import yaml  # noqa: E402
from race_report import report, summarize  # noqa: E402

# A random model is never exactly right: for a check on the tiny model both sides get partial credit instead.
TINY_REWARD = "lightning_grpo.rewards.numeric_closeness"


# -- snapshots and the training clock ---------------------------------------------------------------------------------


class Snapshots:
    """Saves the policy to `folder/step_<n>.safetensors` with the training clock paused; records (step, seconds)."""

    def __init__(self, folder: Path, every: int) -> None:
        self.folder, self.every = folder, every
        self.folder.mkdir(parents=True, exist_ok=True)
        self.started: float | None = None
        self.first_step_s: float | None = None  # training seconds before the training loop began
        self.paused_s = 0.0
        self.taken: list[dict[str, Any]] = []

    def start(self) -> None:
        self.started = time.perf_counter()

    def training_seconds(self) -> float:
        return time.perf_counter() - self.started - self.paused_s

    def step_begins(self) -> None:
        if self.first_step_s is None:
            self.first_step_s = self.training_seconds()

    def maybe_save(self, model: torch.nn.Module, step: int, last: bool = False) -> None:
        if step in {s["step"] for s in self.taken} or not (last or step % self.every == 0):
            return
        from safetensors.torch import save_file

        seconds = self.training_seconds()
        paused = time.perf_counter()
        path = self.folder / f"step_{step:04d}.safetensors"
        tensors = {name: p.detach().contiguous().cpu() for name, p in model.state_dict().items()}
        save_file(_untied(tensors), str(path))
        self.paused_s += time.perf_counter() - paused
        self.taken.append({"step": step, "training_s": round(seconds, 2), "path": str(path)})


def _untied(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop tensors that share storage with an earlier one (a tied LM head), which safetensors refuses."""
    seen, kept = set(), {}
    for name, tensor in tensors.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            kept[name] = tensor
    return kept


# -- our side ---------------------------------------------------------------------------------------------------------


def run_ours(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    import lightning.pytorch as pl
    import pandas as pd
    from lightning.pytorch.loggers import CSVLogger

    from lightning_grpo import AutoPrecision, GRPODataModule, GRPOModule
    from lightning_grpo.cli.main_job import DEFAULT_CONFIG

    config = yaml.safe_load(Path(DEFAULT_CONFIG).read_text())
    pl.seed_everything(args.seed)
    data = {**config["data"], "dataset_size": args.train_size, "val_size": args.val_size, "seed": args.seed}
    data |= json.loads(args.ours_data)
    data["reward_funcs"] = [args.reward]
    data["generator_dtype"] = None if args.generator_dtype == "none" else args.generator_dtype
    module = GRPOModule(**{**config["model"], "model": args.model, **json.loads(args.ours_model)})
    datamodule = GRPODataModule(**data)
    snapshots = Snapshots(out / "snapshots", args.snapshot_every)

    class SnapshotCallback(pl.Callback):
        # Runs before the module's callbacks (they are appended after the trainer's), so a snapshot is taken when
        # the optimizer step is done, before the weight push and before the look-ahead waits for the next step.
        def on_fit_start(self, trainer, pl_module) -> None:
            snapshots.start()

        def on_train_start(self, trainer, pl_module) -> None:  # the rollout process is up, the weights pushed
            snapshots.step_begins()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            snapshots.maybe_save(pl_module.policy, trainer.global_step)

        def on_train_end(self, trainer, pl_module) -> None:
            snapshots.maybe_save(pl_module.policy, trainer.global_step, last=True)

    precision = {"plugins": [AutoPrecision()]} if args.precision == "auto" else {"precision": args.precision}
    trainer = common.quiet_cpu_trainer(
        **precision,
        max_steps=args.max_steps or -1,
        logger=CSVLogger(out, name="metrics", version=0),
        callbacks=[SnapshotCallback()],
    )
    started = time.perf_counter()
    trainer.fit(module, datamodule=datamodule)
    wall = time.perf_counter() - started
    metrics = pd.read_csv(Path(trainer.logger.log_dir) / "metrics.csv")

    def total(name: str) -> float:
        return float(metrics[name].sum()) if name in metrics else 0.0

    training_s = snapshots.taken[-1]["training_s"]
    breakdown = {
        "start_up_s": snapshots.first_step_s,  # spawning the rollout process, the first weight push
        "forward_backward_s": total("perf/fwd_bwd_s"),
        "waiting_for_rollouts_s": total("perf/rollout_wait_s"),
        "weight_push_s": total("perf/weight_sync_s"),
    }
    breakdown["other_s"] = training_s - sum(breakdown.values())
    return {
        "snapshots": snapshots.taken,
        "optimizer_steps": trainer.global_step,
        "training_s": training_s,
        "snapshot_pause_s": round(snapshots.paused_s, 2),
        "wall_s": round(wall, 2),
        "breakdown": breakdown,
        "precision": _chosen(args.precision, trainer.precision_plugin.precision),
        "generator_dtype": data.get("generator_dtype"),
        "overrides": json.loads(args.ours_data) | json.loads(args.ours_model),
        "seed": args.seed,
        "note": "generation runs in the rollout process, overlapping the trainer's time",
    }


def _chosen(requested: str, precision: str) -> str:
    """The precision a side trained in, and that it was chosen for the machine where it was."""
    return f"auto: {precision}" if requested == "auto" else precision


# -- TRL's side -------------------------------------------------------------------------------------------------------


class _Timer:
    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, func):
        @functools.wraps(func)
        def timed(*a, **kw):
            started = time.perf_counter()
            try:
                return func(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - started

        return timed


def run_trl(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from lightning_grpo._imports import resolve_callable
    from lightning_grpo.cli.main_job import DEFAULT_CONFIG
    from lightning_grpo.data.sources import load_prompts
    from lightning_grpo.models import load_policy, load_tokenizer
    from lightning_grpo.training.precision_plugin import choose_precision

    config = yaml.safe_load(Path(DEFAULT_CONFIG).read_text())
    data, hp = config["data"], config["model"]
    precision = choose_precision("cpu")[0] if args.precision == "auto" else args.precision
    torch.manual_seed(args.seed)
    model = load_policy(args.model, dtype=getattr(torch, hp.get("dtype", "float32")))
    tokenizer = load_tokenizer(args.model)
    train = load_prompts("arithmetic", size=args.train_size, seed=data["dataset_seed"])
    groups_per_step = data["gradient_accumulation_steps"] * data["samples_per_row"] // data["num_generations"]
    generation, rewards, steps, micro = _Timer(), _Timer(), _Timer(), _Timer()
    model.generate = generation.wrap(model.generate)
    reward = rewards.wrap(resolve_callable(args.reward, "reward_funcs"))
    # fused: TRL's default optimizer (`optim="adamw_torch_fused"`), which ours uses too
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=hp["learning_rate"], weight_decay=hp["weight_decay"], fused=True
    )
    warmup = hp["warmup_steps"]
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / (warmup + 1)))
    snapshots = Snapshots(out / "snapshots", args.snapshot_every)

    class SnapshotCallback(TrainerCallback):
        def on_train_begin(self, args_, state, control, **kwargs):
            snapshots.start()

        def on_step_begin(self, args_, state, control, **kwargs):
            snapshots.step_begins()
            self.step_started = time.perf_counter()

        def on_step_end(self, args_, state, control, **kwargs):
            steps.seconds += time.perf_counter() - self.step_started
            snapshots.maybe_save(model, state.global_step)

        def on_train_end(self, args_, state, control, **kwargs):
            snapshots.maybe_save(model, state.global_step, last=True)

    class TimedGRPOTrainer(GRPOTrainer):
        def training_step(self, *a, **kw):
            return micro.wrap(super().training_step)(*a, **kw)

    trl_config = GRPOConfig(
        output_dir=str(out / "trl_output"),
        use_cpu=True,
        bf16=precision == "bf16-mixed",  # autocast with fp32 weights, as Lightning's bf16-mixed
        gradient_checkpointing=False,
        per_device_train_batch_size=data["samples_per_row"],
        gradient_accumulation_steps=data["gradient_accumulation_steps"],
        num_generations=data["num_generations"],
        max_completion_length=data["max_completion_length"],
        temperature=data["temperature"],
        top_p=data.get("top_p", 1.0),
        epsilon=hp["epsilon"],
        beta=0.0,
        loss_type="dapo",
        max_grad_norm=hp["max_grad_norm"],
        num_train_epochs=data["epochs"],
        max_steps=args.max_steps or -1,
        seed=args.seed,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        remove_unused_columns=False,
        dataloader_num_workers=0,
    )
    trainer = TimedGRPOTrainer(
        model=model,
        reward_funcs=[reward],
        args=trl_config,
        train_dataset=train,
        processing_class=tokenizer,
        callbacks=[SnapshotCallback()],
        optimizers=(optimizer, scheduler),
    )
    trainer.remove_callback(PrinterCallback)  # its log lines are kept in `log_history`
    started = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - started
    training_s = snapshots.taken[-1]["training_s"]
    breakdown = {
        "start_up_s": snapshots.first_step_s,
        "generation_s": generation.seconds,
        "reward_s": rewards.seconds,
        "forward_backward_s": micro.seconds - generation.seconds - rewards.seconds,
        "optimizer_and_rest_of_step_s": steps.seconds - micro.seconds,
    }
    breakdown["other_s"] = training_s - sum(breakdown.values())
    return {
        "snapshots": snapshots.taken,
        "optimizer_steps": trainer.state.global_step,
        "prompts_per_step": groups_per_step,
        "seed": args.seed,
        "precision": _chosen(args.precision, precision),
        "training_s": training_s,
        "snapshot_pause_s": round(snapshots.paused_s, 2),
        "wall_s": round(wall, 2),
        "breakdown": breakdown,
        "log_history": trainer.state.log_history,
    }


# -- the evaluator ----------------------------------------------------------------------------------------------------


def evaluate(args: argparse.Namespace, sides: dict[str, dict[str, Any]]) -> None:
    """Greedy held-out accuracy of the initial policy and of every snapshot, in place in `sides`."""
    import asyncio

    from safetensors.torch import load_file

    from lightning_grpo._imports import resolve_callable
    from lightning_grpo.cli.main_job import DEFAULT_CONFIG
    from lightning_grpo.data.sources import load_prompts
    from lightning_grpo.models import load_policy, load_tokenizer
    from lightning_grpo.rollout.generator import EmbeddedGenerator

    config = yaml.safe_load(Path(DEFAULT_CONFIG).read_text())
    data = config["data"]
    torch.set_num_threads(os.cpu_count() or 1)
    tokenizer = load_tokenizer(args.model)
    rows = list(load_prompts("arithmetic", size=args.val_size, seed=data["dataset_seed"] + 10_000))
    prompts = [
        tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, return_dict=False) for row in rows
    ]
    reward = resolve_callable(args.reward, "reward_funcs")

    def accuracy(weights: str | None) -> float:
        model = load_policy(args.model)
        if weights is not None:
            with torch.no_grad():
                model.load_state_dict(load_file(weights), strict=False)  # a tied LM head was saved once
        eos = sorted({tokenizer.eos_token_id, *_as_list(model.generation_config.eos_token_id)} - {None})
        generator = EmbeddedGenerator(
            model, eos_token_ids=eos, temperature=0.0, max_tokens=data["max_completion_length"], max_batch_size=96
        )

        async def run():
            return await asyncio.gather(*(generator.generate(p) for p in prompts))

        with generator:
            outputs = asyncio.run(run())
        completions = [
            [{"role": "assistant", "content": tokenizer.decode(o.token_ids, skip_special_tokens=True)}] for o in outputs
        ]
        scores = reward(completions=completions, answer=[row["answer"] for row in rows])
        return sum(float(s or 0.0) for s in scores) / len(scores)

    initial = accuracy(None)
    print(f"initial policy: held-out accuracy {initial:.3f}", flush=True)
    for name, side in sides.items():
        side["curve"] = [{"step": 0, "training_s": 0.0, "accuracy": initial}]
        for snapshot in side["snapshots"]:
            snapshot["accuracy"] = accuracy(snapshot["path"])
            side["curve"].append({k: snapshot[k] for k in ("step", "training_s", "accuracy")})
            print(
                f"{name:>5} step {snapshot['step']:>3} at {snapshot['training_s']:>7.0f} s: {snapshot['accuracy']:.3f}"
            )
            if not args.keep_snapshots:
                Path(snapshot["path"]).unlink()


def _as_list(ids: Any) -> list[int]:
    if ids is None:
        return []
    return [ids] if isinstance(ids, int) else list(ids)


# -- main -------------------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--train-size", type=int, default=192, help="builtin arithmetic problems to train on")
    parser.add_argument("--val-size", type=int, default=96, help="held-out problems to score snapshots on")
    parser.add_argument("--snapshot-every", type=int, default=4, help="optimizer steps between snapshots")
    parser.add_argument("--max-steps", type=int, default=0, help="cap both sides' optimizer steps (0: one epoch)")
    parser.add_argument("--reward", default=None, help="reward import path (default: accuracy; tiny: partial credit)")
    parser.add_argument(
        "--precision", choices=["32-true", "bf16-mixed", "auto"], default="auto",
        help="both sides' training precision: fp32, or fp32 weights under bf16 autocast (TRL: bf16=True), or auto "
        "(the command's default): ours with AutoPrecision, TRL with what AutoPrecision chooses on this machine",
    )  # fmt: skip
    parser.add_argument(
        "--generator-dtype", choices=["none", "auto", "float32", "bfloat16"], default="auto",
        help="our embedded generator's dtype (GRPODataModule's generator_dtype, default auto; none: the policy's)",
    )  # fmt: skip
    parser.add_argument("--ours-model", default="{}", help="JSON of GRPOModule options over the config's, ours only")
    parser.add_argument(
        "--ours-data",
        default="{}",
        help='JSON of GRPODataModule options over the config\'s, ours only, e.g. {"max_staleness": 1}',
    )
    parser.add_argument(
        "--seed", type=int, default=0,
        help="both sides' run seed (sampling and prompt order; the problems stay those of the config's dataset_seed)",
    )  # fmt: skip
    parser.add_argument("--sides", nargs="+", choices=["ours", "trl"], default=["ours", "trl"])
    parser.add_argument("--out", default=None, help="output folder (default: runs/learning/<time>)")
    parser.add_argument("--keep-snapshots", action="store_true")
    parser.add_argument(
        "--reuse",
        default=None,
        help="an earlier run's output folder: the sides not in --sides are taken from its race.json, as trained and "
        "scored there (e.g. rerun ours after a change against the same TRL run)",
    )
    parser.add_argument(
        "--summarize", nargs="+", default=None, help="earlier runs' output folders: report them side by side"
    )
    parser.add_argument("--side", choices=["ours", "trl"], help=argparse.SUPPRESS)  # one side, in its own process
    args = parser.parse_args()
    if args.summarize:
        summarize([Path(folder) for folder in args.summarize], Path(args.out or "."))
        return
    args.reward = args.reward or (TINY_REWARD if args.model.startswith("tiny") else "lightning_grpo.rewards.accuracy")
    out = Path(args.out or Path("runs") / "learning" / time.strftime("%Y%m%d-%H%M%S"))
    if args.side:
        result = (run_ours if args.side == "ours" else run_trl)(args, out / args.side)
        (out / args.side / "timeline.json").write_text(json.dumps(result, indent=2))
        return

    out.mkdir(parents=True, exist_ok=True)
    # the command, commit, machine and date, which `--summarize` carries into `learning_race.json` for the results page
    command = common.provenance("python benchmarks/learning.py " + " ".join(sys.argv[1:]))
    (out / "provenance.json").write_text(json.dumps(command, indent=2))
    print(
        f"{common.machine()}; {args.model}, {args.train_size} "
        f"training / {args.val_size} held-out problems, reward {args.reward}; output in {out}",
        flush=True,
    )
    sides = {}
    for side in args.sides:
        command = [sys.executable, __file__, "--side", side, "--out", str(out)]
        command += [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k in _FORWARDED]
        print(f"training {side} ...", flush=True)
        started = time.perf_counter()
        subprocess.run(command, check=True)
        sides[side] = json.loads((out / side / "timeline.json").read_text())
        print(
            f"  {side}: {sides[side]['optimizer_steps']} steps, {sides[side]['training_s']:.0f} training s "
            f"({time.perf_counter() - started:.0f} s with start-up)",
            flush=True,
        )
    evaluate(args, sides)
    if args.reuse:
        earlier = json.loads((Path(args.reuse) / "race.json").read_text())
        for name in ("ours", "trl"):
            if name not in sides and name in earlier:
                sides[name] = earlier[name] | {"reused_from": str(args.reuse)}
                print(f"{name}: as trained and scored in {args.reuse}", flush=True)
        sides = {name: sides[name] for name in ("ours", "trl") if name in sides}
    if set(sides) == {"ours", "trl"}:
        report(sides, out)
    else:
        (out / "race.json").write_text(json.dumps(sides, indent=2))


_FORWARDED = (
    "model",
    "train_size",
    "val_size",
    "snapshot_every",
    "max_steps",
    "reward",
    "precision",
    "generator_dtype",
    "ours_data",
    "ours_model",
    "seed",
)


if __name__ == "__main__":
    main()
