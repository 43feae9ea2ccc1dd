"""Rewards/s: RewardProcessPool against TRL's way (`asyncio.to_thread` over `trl.rewards.accuracy_reward`).

Both sides score the same 2,000 model-like completions for synthetic arithmetic, 8 per prompt, one call per group,
every group in flight at once (as TRL's rollout loop scores finished groups concurrently). Then again with 1% poison
completions (`\\boxed{9^{9^{9^{9}}}}`), on which sympy holds the GIL: in a thread, math_verify's timeouts are off and
the whole process freezes. The TRL side therefore runs in a subprocess with a wall-clock limit, killed if need be.
Warm-up excluded; the clean run reports the median of `--reps`, the poison run one pass.

    python benchmarks/reward_pool.py [--workers N] [--reps 3] [--trl-limit 90]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial

import common  # noqa: I001  (first: sets the offline environment before torch and TRL load)

GROUP_SIZE = 8
NUM_COMPLETIONS = 2000
POISON = "Let me think step by step. \\boxed{9^{9^{9^{9}}}}"
WARMUP_GROUPS = 16


def make_groups(poison_frac: float, seed: int = 0) -> list[dict]:
    """Reward kwargs per group as TRL passes them: completions (conversational), prompts, completion_ids, columns."""
    rng = random.Random(seed)
    groups = []
    for _ in range(NUM_COMPLETIONS // GROUP_SIZE):
        a, b, op = rng.randint(10, 99), rng.randint(1, 9), rng.choice("+*-")
        gold = {"+": a + b, "*": (a % 10) * b, "-": a - b}[op]
        a = a % 10 if op == "*" else a
        prompt = [{"role": "user", "content": f"What is {a} {op} {b}? Put the final answer in \\boxed{{}}."}]
        texts = [_completion(rng, a, op, b, gold) for _ in range(GROUP_SIZE)]
        groups.append(
            {
                "completions": [[{"role": "assistant", "content": t}] for t in texts],
                "prompts": [prompt] * GROUP_SIZE,
                "completion_ids": [list(range(len(t) // 4 + 1)) for t in texts],
                "answer": [str(gold)] * GROUP_SIZE,
                "solution": [str(gold)] * GROUP_SIZE,
            }
        )
    flat = [(g, i) for g in range(len(groups)) for i in range(GROUP_SIZE)]
    for g, i in rng.sample(flat, round(poison_frac * NUM_COMPLETIONS)):
        groups[g]["completions"][i] = [{"role": "assistant", "content": POISON}]
    return groups


def _completion(rng: random.Random, a: int, op: str, b: int, gold: int) -> str:
    wrong = gold + rng.choice([-10, -2, -1, 1, 2, 10])
    templates = [
        f"{a} {op} {b} = {gold}\n\nThe answer is \\boxed{{{gold}}}.",
        f"{a} {op} {b} = {gold}\n\nThe answer is \\boxed{{}}.",
        f"{a} {op} {b} = {wrong}\n\nThe answer is \\boxed{{{wrong}}}.",
        f"{a} {op} {b} = {gold}.",
        f"The answer is {wrong}. Let me double check: {a} {op} {b} is {wrong}.",
        f"To solve {a} {op} {b}, you multiply the numbers {a} and {b}: {a} x {b} = {a * b}.",
        f"{a} {op} {b} = {gold}\nSword.ixture.",
        f"{a} {op} (2 * {b}) = {a} {op} {2 * b} = {wrong}\n{wrong} + 1 = {wrong + 1}",
        f"First, I write the numbers: {a} and {b}. Then I apply {op}. "
        f"Step 1: {a}. Step 2: {b}. So the result is $\\frac{{{2 * gold}}}{{2}}$, i.e. \\boxed{{{gold}}}.",
        "I am not sure how to solve this problem. Maybe it is a trick question about numbers and signs.",
        "",
    ]
    return rng.choice(templates)


# --------------------------------------------------------------------------------------------- TRL side (child)


def trl_child(mode: str, reps: int) -> None:
    """TRL's way, in this subprocess: every group through `asyncio.to_thread(accuracy_reward, **kwargs)`."""
    from trl.rewards import accuracy_reward

    groups = make_groups(0.0 if mode == "clean" else 0.01)

    async def score_all(batch, report):
        async def one(kwargs):
            rewards = await asyncio.to_thread(accuracy_reward, **kwargs)
            if report:
                print("group", flush=True)
            return rewards

        return await asyncio.gather(*(one(g) for g in batch))

    asyncio.run(score_all(make_groups(0.0)[:WARMUP_GROUPS], False))
    print("start", flush=True)
    times = []
    for _ in range(reps if mode == "clean" else 1):
        started = time.perf_counter()
        rewards = asyncio.run(score_all(groups, mode == "poison"))
        times.append(time.perf_counter() - started)
    print(json.dumps({"times": times, "summary": summarize(rewards)}), flush=True)


def run_trl_side(mode: str, reps: int, limit_s: float) -> dict:
    """Runs `trl_child` in a subprocess; kills it `limit_s` seconds after its warm-up if it has not finished."""
    proc = subprocess.Popen(
        [sys.executable, __file__, "--trl-child", mode, "--reps", str(reps)], stdout=subprocess.PIPE, text=True
    )
    lines: list[str] = []
    started = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line.strip())
            if line.strip() == "start":
                started.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    started.wait(timeout=300)
    try:
        proc.wait(timeout=limit_s * (reps if mode == "clean" else 1))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    reader.join(timeout=5)
    result = next((json.loads(line) for line in lines if line.startswith("{")), None)
    if result is None:
        return {"finished": False, "groups_done": lines.count("group"), "limit_s": limit_s}
    return {"finished": True, **result}


# ------------------------------------------------------------------------------------------------ our side


def run_pool_side(reward_func, groups: list[dict], workers: int, timeout: float, reps: int) -> dict:
    from lightning_grpo.rollout.reward_pool import RewardProcessPool

    async def score_all(pool, batch):
        return await asyncio.gather(*(pool.score(0, **g) for g in batch))

    with RewardProcessPool([reward_func], num_workers=workers, timeout=timeout) as pool:
        asyncio.run(score_all(pool, make_groups(0.0)[:WARMUP_GROUPS]))
        before = pool.stats()
        times = []
        for _ in range(reps):
            started = time.perf_counter()
            rewards = asyncio.run(score_all(pool, groups))
            times.append(time.perf_counter() - started)
        after = pool.stats()
    delta = {
        k.split("/")[1]: after[k] - before[k] for k in ("reward_pool/timeouts_total", "reward_pool/restarts_total")
    }
    return {"finished": True, "times": times, "summary": summarize(rewards), **delta}


def measure_restart() -> tuple[float, float, float]:
    """Seconds to start a 1-worker pool (bare; with `accuracy`), and extra latency of a call whose worker died once."""
    from lightning_grpo.rewards import accuracy
    from lightning_grpo.rollout.reward_pool import RewardProcessPool

    starts = []
    for _ in range(3):
        started = time.perf_counter()
        RewardProcessPool([len], num_workers=1).close()
        starts.append(time.perf_counter() - started)

    with tempfile.TemporaryDirectory() as tmp:
        marker = os.path.join(tmp, "died")

        def dies_once(completions, **kwargs):
            if not os.path.exists(marker):
                open(marker, "w").close()
                os._exit(1)
            return accuracy(completions, **kwargs)

        started = time.perf_counter()
        with RewardProcessPool([accuracy, dies_once], num_workers=1, timeout=60) as pool:
            start_s = time.perf_counter() - started
            kwargs = make_groups(0.0)[0]
            pool.submit(0, **kwargs).result()
            t0 = time.perf_counter()
            pool.submit(0, **kwargs).result()
            normal = time.perf_counter() - t0
            t0 = time.perf_counter()
            pool.submit(1, **kwargs).result()
            restart_s = time.perf_counter() - t0 - normal
    return statistics.median(starts), start_s, restart_s


# ----------------------------------------------------------------------------------------------------- report


def summarize(rewards: list[list[float | None]]) -> dict:
    flat = [float("nan") if r is None else r for group in rewards for r in group]
    scored = [r for r in flat if not math.isnan(r)]
    return {"mean_reward": sum(scored) / max(len(scored), 1), "nan": len(flat) - len(scored)}


def row(name: str, result: dict, baseline_rps: float | None) -> tuple[str, float | None]:
    if not result["finished"]:
        text = f"did not finish in {result['limit_s']:.0f} s, {result['groups_done']} groups done"
        return f"| {name:<58} | {text:<44} | {'-':>8} | {'-':>6} | {'-':>7} |", None
    seconds = statistics.median(result["times"])
    rps = NUM_COMPLETIONS / seconds
    ratio = "1.00x" if baseline_rps == 0.0 else (f"{rps / baseline_rps:.2f}x" if baseline_rps else "TRL hung")
    extra = f", {result['timeouts_total']:.0f} timeouts" if result.get("timeouts_total") else ""
    text = f"{rps:9.0f} rewards/s ({seconds:.2f} s{extra})"
    summary = result["summary"]
    return (
        f"| {name:<58} | {text:<44} | {ratio:>8} | {summary['mean_reward']:6.3f} | {summary['nan']:>7} |",
        rps,
    )


def table(title: str, rows: list[tuple[str, dict]]) -> None:
    print(f"\n{title}")
    print(f"| {'side':<58} | {'throughput':<44} | {'vs TRL':>8} | {'mean r':>6} | {'NaN':>7} |")
    print(f"|{'-' * 60}|{'-' * 46}|{'-' * 10}|{'-' * 8}|{'-' * 9}|")
    baseline = 0.0  # the first row is the baseline; None once it did not finish
    for name, result in rows:
        line, rps = row(name, result, baseline)
        baseline = rps if baseline == 0.0 else baseline
        print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--trl-limit", type=float, default=90.0, help="wall-clock limit (s) of a TRL-side pass")
    parser.add_argument("--trl-child", choices=["clean", "poison"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_child:
        return trl_child(args.trl_child, args.reps)

    from trl.rewards import accuracy_reward

    from lightning_grpo.rewards import accuracy

    logging.getLogger("lightning_grpo.rollout.reward_pool").setLevel(logging.ERROR)  # expected timeouts: counted below
    commit = common.git_commit()
    print(
        f"commit {commit or '?'}; {common.machine()}; "
        f"python {platform.python_version()}; {NUM_COMPLETIONS} completions, {GROUP_SIZE} per call; "
        f"pool workers={args.workers}"
    )
    bare_s, start_s, restart_s = measure_restart()
    print(
        f"worker start: bare {bare_s:.2f} s, with accuracy (imports math_verify) {start_s:.2f} s; "
        f"worker death -> respawn -> retry, extra latency: {restart_s:.2f} s"
    )

    w = args.workers
    clean = make_groups(0.0)
    table(
        f"Clean: median of {args.reps} passes",
        [
            ("TRL: asyncio.to_thread(trl accuracy_reward)", run_trl_side("clean", args.reps, args.trl_limit)),
            ("ours: pool(1) + trl accuracy_reward", run_pool_side(accuracy_reward, clean, 1, 60.0, args.reps)),
            (f"ours: pool({w}) + trl accuracy_reward", run_pool_side(accuracy_reward, clean, w, 60.0, args.reps)),
            (f"ours: pool({w}) + lightning_grpo accuracy", run_pool_side(accuracy, clean, w, 60.0, args.reps)),
        ],
    )
    poisoned = make_groups(0.01)
    quick = partial(accuracy, timeout_seconds=1)
    table(
        "1% poison completions: one pass",
        [
            ("TRL: asyncio.to_thread(trl accuracy_reward)", run_trl_side("poison", 1, args.trl_limit)),
            (f"ours: pool({w}, timeout=60) + trl accuracy_reward", run_pool_side(accuracy_reward, poisoned, w, 60, 1)),
            (f"ours: pool({w}, timeout=60) + accuracy(timeout_seconds=1)", run_pool_side(quick, poisoned, w, 60, 1)),
            (f"ours: pool({w}, timeout=2) + lightning_grpo accuracy", run_pool_side(accuracy, poisoned, w, 2.0, 1)),
        ],
    )
    print(
        "\nmean r: mean of the scored rewards (TRL's accuracy_reward needs LaTeX, ours also reads a plain last "
        "number);\nNaN: completions not scored. In a worker (main thread) math_verify's own alarm (5 s, or "
        "timeout_seconds)\nscores a poison 0.0; with timeout=2 the pool kills the worker first and the poisoned "
        "group is NaN."
    )


if __name__ == "__main__":
    main()
