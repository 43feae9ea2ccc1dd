"""Multi-turn rollouts for real: the rollout child (embedded generator) runs conversations of the tiny policy taught to
call `lookup` (`tool_policy.py`) with scripted environments, and every fault of a tool or an environment stays in its
rollout. Nothing is faked: a spawned child, cloudpickled environments, the real chat template and TRL's parser.
"""

from __future__ import annotations

import math
import queue
import time
from collections import defaultdict

import numpy as np
import pytest
from datasets import Dataset
from helpers.rollouts import collect_groups
from helpers.tool_policy import (
    PROMPT,
    BrokenResetEnv,
    BrokenRewardEnv,
    HangingEnv,
    LoopingEnv,
    RaisingEnv,
    UnprintableEnv,
    check_conversation_samples,
    notebook_environment,
)

from lightning_grpo._trl import TreeRow
from lightning_grpo.rollout.generator import GeneratorSpec, PolicySpec
from lightning_grpo.rollout.worker import GRPORolloutWorker
from lightning_grpo.weights.shared_memory import SharedMemoryWeightTransfer

TEMPERATURE = 0.7  # sharp enough that the taught policy writes its calls, still sampled
MAX_TOKENS = 80  # a call is 69 tokens of the character tokenizer


def start_worker(policy, tokenizer, transfer, *, num_generations: int, **options) -> GRPORolloutWorker:
    generator = GeneratorSpec(
        policy=PolicySpec.from_model(policy),
        eos_token_ids=(tokenizer.eos_token_id,),
        temperature=TEMPERATURE,
        max_tokens=MAX_TOKENS,
        weight_receiver=transfer.receiver(),
        seed=0,
    )
    worker = GRPORolloutWorker(
        child_ready_timeout=120,
        model_name="tiny",
        processing_class=tokenizer,
        eos_token_ids=[tokenizer.eos_token_id],
        reward_funcs=[],
        num_generations=num_generations,
        max_inflight_tasks=16,
        max_tokens=MAX_TOKENS,
        temperature=TEMPERATURE,
        reward_num_workers=0,
        generator=generator,
        **options,
    )
    worker.start()
    return worker


@pytest.fixture
def transfer(tool_policy):
    transfer = SharedMemoryWeightTransfer(tool_policy)
    transfer.pause()
    transfer.send_weights(tool_policy.named_parameters(), version=0)
    transfer.resume()
    yield transfer
    transfer.destroy()


def drain_metrics(worker, settle_s: float = 1.0) -> dict[str, float]:
    """Every counter the child pushed so far, summed (its `*_total` counters are increments)."""
    totals: dict[str, float] = defaultdict(float)
    deadline = time.monotonic() + settle_s
    while time.monotonic() < deadline:
        try:
            pushed = worker.metrics_queue.get(timeout=0.1)
        except queue.Empty:
            continue
        for key, value in pushed.items():
            totals[key] += value[0] if isinstance(value, tuple) else value
    return totals


@pytest.mark.timeout(300)
def test_a_notebook_environments_tool_calls_train_only_the_policys_tokens_with_exact_logprobs(
    tool_policy, tokenizer, transfer, no_leaked_processes
):
    """Samples of conversations with a tool: the masks train exactly the policy's replies (not the prompt, not the
    tool results), the logprobs are a teacher-forced forward of the whole conversation, the environment's reward is
    the reward column the advantages come from. The environment class is defined the way a notebook cell defines
    it, in a module the child cannot import, so only cloudpickle can ship it."""
    environment = notebook_environment()
    dataset = Dataset.from_dict({"prompt": [PROMPT] * 2})
    worker = start_worker(tool_policy, tokenizer, transfer, num_generations=4, dataset=dataset,
                          environment_factory=environment, max_tool_calling_iterations=2)  # fmt: skip
    try:
        groups = collect_groups(worker, 2)
        metrics = drain_metrics(worker)
    finally:
        worker.stop()
    assert sorted(groups) == [0, 1]
    calls = 0
    for samples in groups.values():
        called = check_conversation_samples(
            samples, tool_policy, tokenizer, temperature=TEMPERATURE, reward_column="NotebookLookupEnv"
        )
        assert called >= 1, [s.completion for s in samples]  # the policy called its tool in every group
        row = TreeRow()  # what a training row forwards: the group's conversations share their prompt at least
        for sample in samples:
            row.add({"input_ids": sample.input_ids, "completion_mask": sample.completion_mask, "group_id": 0})
        prompt = int(samples[0].completion_mask.argmax())
        assert len(row.tokens) <= sum(s.num_tokens for s in samples) - (len(samples) - 1) * (prompt - 1)
        calls += sum(s.metrics.get("tools/call_frequency", 0) for s in samples)
        assert all(s.model_version == 0 for s in samples)
    assert metrics["tools/lookup/call_total"] == calls
    assert metrics.get("tools/lookup/failure_total", 0) == 0


@pytest.mark.timeout(300)
def test_raising_hanging_and_unprintable_tools_answer_with_errors_and_failing_environments_score_nan(
    tool_policy, tokenizer, transfer, no_leaked_processes
):
    """One environment per fault, one group each: a tool that raises, hangs past `tool_timeout` or returns something
    unprintable answers the policy with an error message and is counted; a `get_reward` that raises scores its
    column NaN and a `reset` that raises scores the rollout NaN in every column (never 0); a policy that never stops
    calling tools ends at `max_tool_calling_iterations`. The run goes on, and stops promptly with a tool still hung."""
    factories = {
        "raise": RaisingEnv,
        "hang": HangingEnv,
        "unprintable": UnprintableEnv,
        "reward": BrokenRewardEnv,
        "reset": BrokenResetEnv,
        "loop": LoopingEnv,
    }
    dataset = Dataset.from_dict({"prompt": [PROMPT] * len(factories), "environment": list(factories)})
    worker = start_worker(tool_policy, tokenizer, transfer, num_generations=2, dataset=dataset, shuffle=False,
                          environment_factory=factories, tool_timeout=1.0, max_tool_calling_iterations=1)  # fmt: skip
    try:
        groups = collect_groups(worker, len(factories), timeout=240)
        metrics = drain_metrics(worker)
    finally:
        started = time.monotonic()
        worker.stop()  # a HangingEnv.lookup thread is still sleeping in the child
        stop_s = time.monotonic() - started
    assert stop_s < 10
    by_env = {name: groups[i] for i, name in enumerate(factories)}

    def tool_results(name: str) -> list[str]:
        return [m["content"] for s in by_env[name] for m in s.completion if m["role"] == "tool"]

    assert tool_results("raise") and all("no such key: k" in r for r in tool_results("raise"))
    assert tool_results("hang") and all("did not return within 1.0 s" in r for r in tool_results("hang"))
    assert tool_results("unprintable") and all("cannot be printed" in r for r in tool_results("unprintable"))
    for name in ("raise", "hang", "unprintable"):
        calls = [s for s in by_env[name] if s.metrics.get("tools/call_frequency")]
        assert calls and all(s.metrics["tools/failure_frequency"] == 1.0 for s in calls)
    assert metrics["tools/timeout_total"] == len(tool_results("hang"))
    assert metrics["tools/lookup/failure_total"] == sum(
        len(tool_results(n)) for n in ("raise", "hang", "unprintable", "reset")
    )

    for sample in by_env["reward"]:  # get_reward raised: its column is not scored
        assert math.isnan(sample.metrics["rewards/BrokenRewardEnv"]) and math.isnan(sample.metrics["reward"])
        assert sample.advantage == 0.0
    for sample in by_env["reset"]:  # reset raised: nothing about the rollout is scored
        rewards = [v for k, v in sample.metrics.items() if k.startswith("rewards/")]
        assert rewards and all(math.isnan(v) for v in rewards) and sample.advantage == 0.0
    assert metrics["env/reward_errors_total"] == 2 and metrics["env/reset_errors_total"] == 2

    looping = [s for s in by_env["loop"] if s.metrics.get("tools/call_frequency")]
    asked = [len([m for m in s.completion if m.get("tool_calls")]) for s in looping]
    # Call, "again", call: refused, one tool round being the limit. The policy is sampled: after "again" it usually
    # calls once more, but may answer instead; never a second tool round.
    assert 2 in asked and set(asked) <= {1, 2}
    assert all(tool_results_of(sample) == ["again"] for sample in looping)
    exhausted = asked.count(2)
    assert metrics["tools/loop_exhausted_frac"] >= exhausted  # the rate's numerator: one per exhausted rollout
    for name in ("raise", "hang", "unprintable", "loop"):
        scored = np.array([s.metrics[f"rewards/{factories[name].__name__}"] for s in by_env[name]])
        assert not np.isnan(scored).any()  # a tool fault is the policy's problem to solve: still scored


def tool_results_of(sample) -> list[str]:
    return [m["content"] for m in sample.completion if m["role"] == "tool"]
