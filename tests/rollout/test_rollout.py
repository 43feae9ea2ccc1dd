"""The rollout child for real: GRPORolloutWorker spawns GRPORolloutLoop with the embedded generator on the tiny model.

Every test here spawns a real child process (and its reward-pool worker), generates with the tiny random Llama and
scores with real reward functions shipped by cloudpickle; nothing is faked.
"""

from __future__ import annotations

import copy
import os
import queue
import signal
import threading
import time

import numpy as np
import psutil
import pytest
import torch
from helpers.fit_rewards import (
    ChildOnlyReward,
    async_raises_on_say_1,
    environment_mark,
    hangs_on_say_0,
    kernel_cache_capacity,
    signal_on_odd_prompts,
)
from helpers.rollouts import check_stopped_samples, collect_groups, counters_until, drained_rate
from helpers.tiny import tiny_prompts as prompts
from helpers.transfers import push

from lightning_grpo.rollout import start_method
from lightning_grpo.rollout.advantages import compute_group_advantages
from lightning_grpo.rollout.generator import GeneratorSpec, PolicySpec
from lightning_grpo.rollout.records import NO_SIGNAL, SCORE_PAYLOAD
from lightning_grpo.rollout.sampling import teacher_forced_logprobs
from lightning_grpo.rollout.worker import GRPORolloutWorker

G = 4  # generations per group
MAX_TOKENS = 10


def length_reward():
    """Reward = completion length in characters: varies within a group, so groups carry a learning signal."""
    return lambda completions, **kwargs: [float(len(c[0]["content"])) for c in completions]


def start_worker(model, tokenizer, transfer, generator_options=None, **overrides) -> GRPORolloutWorker:
    """A started worker whose embedded generator gets its weights from `transfer` (the model's config, no weights)."""
    generator = GeneratorSpec(
        policy=PolicySpec.from_model(model),
        eos_token_ids=(tokenizer.eos_token_id,),
        max_tokens=MAX_TOKENS,
        weight_receiver=transfer.receiver(),
        seed=0,
        **(generator_options or {}),
    )
    worker = GRPORolloutWorker(child_ready_timeout=120, **(worker_options(tokenizer, generator=generator) | overrides))
    worker.start()
    return worker


def worker_options(tokenizer, **overrides) -> dict:
    options = dict(
        model_name="tiny",
        dataset=prompts(4),
        reward_funcs=[length_reward()],
        processing_class=tokenizer,
        eos_token_ids=[tokenizer.eos_token_id],
        num_generations=G,
        max_inflight_tasks=4 * G,
        max_tokens=MAX_TOKENS,
        epochs=1,
        reward_num_workers=1,
        reward_timeout=20.0,
    )
    return options | overrides


@pytest.mark.timeout(180)
def test_groups_arrive_complete_scored_and_with_exact_logprobs(tiny_model, tokenizer, transfer, no_leaked_processes):
    push(transfer, tiny_model, version=0)
    worker = start_worker(tiny_model, tokenizer, transfer, consumed={1})
    try:
        groups = collect_groups(worker, 3)
        assert sorted(groups) == [0, 2, 3]  # the consumed id is skipped, every other id once
        for samples in groups.values():
            assert len(samples) == samples[0].group_rows <= G
            rewards = np.array([[s.metrics["rewards/<lambda>"] for s in samples]])
            _, expected = compute_group_advantages(rewards, np.ones(1))
            np.testing.assert_allclose([s.advantage for s in samples], expected, atol=1e-6)
            for sample in samples:
                assert sample.model_version == 0 and not np.isnan(sample.advantage)
                prompt_len = int((sample.completion_mask == 0).sum())
                completion = sample.input_ids[prompt_len:].tolist()
                assert sample.completion_mask[prompt_len:].all() and len(completion) <= MAX_TOKENS
                assert sample.truncated == (completion[-1] != tokenizer.eos_token_id)
                assert sample.metrics["reward"] == len(sample.completion[0]["content"])
                reference = teacher_forced_logprobs(tiny_model, sample.input_ids[:prompt_len].tolist(), completion)
                np.testing.assert_allclose(sample.old_log_probs[prompt_len:], reference.numpy(), atol=1e-4)
        # The schedule is done: nothing more arrives, and the child idles with its heartbeat alive.
        with pytest.raises(queue.Empty):
            worker.rollout_buffer.get(timeout=1.5)
        worker.check_health(stale_after_s=60)
    finally:
        worker.stop()


@pytest.mark.timeout(180)
def test_weight_push_switches_version_and_logprobs_follow_new_weights(
    tiny_model, tokenizer, transfer, no_leaked_processes
):
    push(transfer, tiny_model, version=0)
    worker = start_worker(tiny_model, tokenizer, transfer, dataset=prompts(6), groups_per_step=1, max_staleness=0)
    new_model = copy.deepcopy(tiny_model)
    with torch.no_grad():
        for param in new_model.parameters():
            param.mul_(1.5)
    try:
        first = collect_groups(worker, 1)
        assert {s.model_version for s in first[0]} == {0}
        push(transfer, new_model, version=1)
        worker.groups_consumed = 1  # pacing admits the next group only now
        later = collect_groups(worker, 1)
        (samples,) = later.values()
        assert {s.model_version for s in samples} == {1}
        for sample in samples:
            prompt_len = int((sample.completion_mask == 0).sum())
            ids = sample.input_ids.tolist()
            expected = teacher_forced_logprobs(new_model, ids[:prompt_len], ids[prompt_len:])
            np.testing.assert_allclose(sample.old_log_probs[prompt_len:], expected.numpy(), atol=1e-4)
    finally:
        worker.stop()


@pytest.mark.timeout(240)
def test_pacing_keeps_staleness_bounded_with_a_slow_consumer(tiny_model, tokenizer, transfer, no_leaked_processes):
    """A consumer that trains slowly and bumps the version every step never sees a group staler than max_staleness,
    the child never runs more than the pacing window ahead, and generation resumes as soon as groups are consumed."""
    groups_per_step, max_staleness = 2, 1
    window = (max_staleness + 1) * groups_per_step
    push(transfer, tiny_model, version=0)
    worker = start_worker(
        tiny_model,
        tokenizer,
        transfer,
        dataset=prompts(6),
        epochs=2,
        groups_per_step=groups_per_step,
        max_staleness=max_staleness,
    )
    version, consumed, staleness = 0, 0, []
    try:
        while consumed < 12:
            step = collect_groups(worker, groups_per_step)
            # Trainer-side view of the child's lead: groups in flight or queued never exceed the window.
            time.sleep(1.0)  # a slow step: the child has time to run ahead if pacing did not hold it
            extra = worker.rollout_buffer.qsize()
            assert extra <= (window - groups_per_step) * G, f"{extra} samples queued beyond the pacing window"
            staleness += [version - s[0].model_version for s in step.values()]
            version += 1
            push(transfer, tiny_model, version=version)
            consumed += groups_per_step
            worker.groups_consumed = consumed
        assert max(staleness) <= max_staleness, staleness
    finally:
        worker.stop()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("replace_early", [True, False])
def test_a_group_without_signal_is_tagged_and_replaced_as_soon_as_it_is_scored(
    tiny_model, tokenizer, transfer, no_leaked_processes, replace_early
):
    """A window of two groups and a trainer that consumes nothing yet. The even prompts' groups have no signal: with
    `replace_early=True` the child tags each and starts its replacement at once, so groups 0-3 arrive and the
    window then holds the two with signal; otherwise it holds after groups 0 and 1. Consuming one group lets the
    next start (and, dropped early, its replacement)."""
    push(transfer, tiny_model, version=0)
    worker = start_worker(
        tiny_model, tokenizer, transfer, dataset=prompts(8), shuffle=False, reward_funcs=[signal_on_odd_prompts],
        groups_per_step=1, max_staleness=1, replace_early=replace_early,
    )  # fmt: skip
    first = 4 if replace_early else 2
    try:
        groups = collect_groups(worker, first)
        time.sleep(3.0)  # room for one more group to arrive, were the window not holding
        assert worker.rollout_buffer.empty()
        assert sorted(groups) == list(range(first))
        tags = {g: all(s.extras.get(NO_SIGNAL, False) for s in samples) for g, samples in groups.items()}
        assert tags == {g: replace_early and g % 2 == 0 for g in groups}
        worker.groups_consumed = 1  # the trainer trained group 1
        following = [4, 5] if replace_early else [2]
        assert sorted(collect_groups(worker, len(following))) == following
    finally:
        worker.stop()


@pytest.mark.timeout(180)
def test_trainer_scored_groups_carry_nan_advantages_and_payload(tiny_model, tokenizer, transfer, no_leaked_processes):
    push(transfer, tiny_model, version=0)
    worker = start_worker(tiny_model, tokenizer, transfer, dataset=prompts(1), trainer_scored=True)
    try:
        (samples,) = collect_groups(worker, 1).values()
        for sample in samples:
            assert np.isnan(sample.advantage)
            payload = sample.extras[SCORE_PAYLOAD]
            assert payload == {"rows": len(samples), "columns": ["<lambda>"], "payload": {}}
            assert not np.isnan(sample.metrics["rewards/<lambda>"])  # its own columns are scored
    finally:
        worker.stop()


@pytest.mark.timeout(180)
def test_thread_and_async_rewards_that_hang_or_raise_score_nan_are_counted_like_pool_rewards_and_the_run_goes_on(
    tiny_model, tokenizer, transfer, no_leaked_processes
):
    """`reward_num_workers=0`: a synchronous reward that hangs on one prompt (in a thread) and an `async def` one
    that raises on another each score NaN in their own column of that group only, are counted in the reward pool's
    metrics (`reward_pool/timeouts_total`, `reward_pool/errors_total`), and every group arrives; the hung thread does
    not keep the child from stopping."""
    push(transfer, tiny_model, version=0)
    rewards = [hangs_on_say_0, async_raises_on_say_1]
    options = dict(dataset=prompts(3), reward_funcs=rewards, reward_num_workers=0, reward_timeout=2.0)
    worker = start_worker(tiny_model, tokenizer, transfer, **options)
    try:
        groups = collect_groups(worker, 3)
        expected = {"reward_pool/timeouts_total": 1.0, "reward_pool/errors_total": 1.0, "reward_pool/calls_total": 6.0}
        counted = counters_until(worker, expected)
    finally:
        worker.stop()
    assert counted == expected
    for samples in groups.values():
        prompt = str(samples[0].prompt)
        hung = np.isnan([s.metrics["rewards/hangs_on_say_0"] for s in samples])
        raised = np.isnan([s.metrics["rewards/async_raises_on_say_1"] for s in samples])
        assert hung.all() == ("Say 0." in prompt) and hung.any() == hung.all(), prompt
        assert raised.all() == ("Say 1." in prompt) and raised.any() == raised.all(), prompt
        assert not np.isnan([s.metrics["reward"] for s in samples]).any()  # the other column scored them


@pytest.mark.timeout(180)
def test_child_killed_with_sigkill_fails_check_health_and_stop_cleans_up(
    tiny_model, tokenizer, transfer, no_leaked_processes
):
    push(transfer, tiny_model, version=0)
    worker = start_worker(tiny_model, tokenizer, transfer, dataset=prompts(2))
    try:
        collect_groups(worker, 1)
        child = psutil.Process(worker.pid)
        os.kill(worker.pid, signal.SIGKILL)
        child.wait(timeout=60)  # the kill took: the child is gone
        # the child's parent (the forkserver) reports its exit status a moment later: the next checks must see it
        deadline = time.monotonic() + 30
        with pytest.raises(RuntimeError, match="killed by signal 9"):
            while time.monotonic() < deadline:
                worker.check_health(stale_after_s=60)
                time.sleep(0.05)
    finally:
        worker.stop()  # also reaps the reward-pool worker orphaned by the kill (the leak check fails otherwise)


@pytest.mark.timeout(120)
def test_bad_loop_argument_fails_start_with_the_childs_message(tiny_model, tokenizer, transfer, no_leaked_processes):
    with pytest.raises(RuntimeError, match=r"reward_weights.*2 entries but there are 1 reward columns"):
        start_worker(tiny_model, tokenizer, transfer, reward_weights=[1.0, 2.0])


@pytest.mark.timeout(120)
def test_a_reward_pool_that_cannot_start_fails_start_with_its_message_and_leaves_no_process(
    tokenizer, no_leaked_processes
):
    """The pool starts while the embedded generator loads the policy; its failure still fails `start()`."""
    options = worker_options(tokenizer, model_name="tiny-random", dataset=prompts(2), reward_funcs=[ChildOnlyReward()])
    worker = GRPORolloutWorker(generator="embedded", child_ready_timeout=120, **options)
    with pytest.raises(RuntimeError, match=r"(?s)could not start its workers.*'ChildOnlyReward' cannot be loaded"):
        worker.start()


def test_unshippable_argument_is_named_before_anything_is_spawned(tiny_model, tokenizer, transfer, no_leaked_processes):
    worker = GRPORolloutWorker(dataset=prompts(1), reward_funcs=[length_reward()], lock=threading.Lock())
    with pytest.raises(TypeError, match="cannot ship `lock="):
        worker.start()
    assert worker.pid is None


@pytest.mark.timeout(180)
def test_hung_child_fails_check_health_once_its_heartbeat_is_stale(
    tiny_model, tokenizer, transfer, no_leaked_processes
):
    push(transfer, tiny_model, version=0)
    worker = start_worker(tiny_model, tokenizer, transfer, dataset=prompts(2))
    try:
        collect_groups(worker, 1)
        worker.check_health(stale_after_s=60)  # alive and ticking
        child = psutil.Process(worker.pid)
        os.kill(worker.pid, signal.SIGSTOP)  # a child that is alive but no longer makes progress
        while child.status() != psutil.STATUS_STOPPED:  # the stop took: its heartbeat can no longer move
            time.sleep(0.05)
        last_beat = worker._heartbeat_value.value  # the last beat the stopped child gave
        while time.time() - last_beat <= 2.5:
            time.sleep(0.05)
        with pytest.raises(RuntimeError, match=r"is hung: no heartbeat for \d+ s \(limit 2 s\)"):
            worker.check_health(stale_after_s=2)
    finally:
        os.kill(worker.pid, signal.SIGCONT)
        worker.stop()


@pytest.mark.timeout(180)
def test_the_low_level_worker_runs_generator_embedded_or_fails_at_construction(tokenizer, no_leaked_processes):
    """`generator="embedded"` (the name the docs use) loads the named policy in the child and samples with the loop's
    options; anything that is not a generator fails in `__init__`, before anything is spawned."""
    from lightning_grpo.models import tiny_llama

    options = worker_options(tokenizer, model_name="tiny-random", dataset=prompts(2), temperature=0.7)
    worker = GRPORolloutWorker(generator="embedded", child_ready_timeout=120, **options)
    worker.start()
    try:
        (group,) = collect_groups(worker, 1).values()
    finally:
        worker.stop()
    model = tiny_llama(seed=0)  # what "tiny-random" loads in the child
    for sample in group:
        start = int(sample.completion_mask.argmax())
        ids = sample.input_ids.tolist()
        expected = teacher_forced_logprobs(model, ids[:start], ids[start:], temperature=0.7)
        assert (expected - torch.from_numpy(sample.old_log_probs[start:])).abs().max() <= 1e-4
    with pytest.raises(TypeError, match=r"generator='sglang'.*GeneratorSpec.*'embedded'"):
        GRPORolloutWorker(model_name="tiny-random", generator="sglang")
    with pytest.raises(TypeError, match=r"generator='embedded'.*model_name="):
        GRPORolloutWorker(generator="embedded")
    with pytest.raises(ValueError, match="temperature=-1"):
        GRPORolloutWorker(model_name="tiny-random", generator="embedded", temperature=-1)


@pytest.mark.timeout(180)
def test_stop_strings_end_completions_untruncated_with_logprobs_of_the_processed_distribution(
    tiny_model, tokenizer, transfer, no_leaked_processes
):
    """min_p, repetition_penalty and stop strings reach the child's generator; a completion that a stop string ended
    is not truncated (no EOS id ends it), and every logprob is that of the distribution its token was drawn from."""
    sampling = {"temperature": 0.9, "min_p": 0.05, "repetition_penalty": 1.3}
    stop = list("aeiou0123")
    options = dict(stop=stop, tokenizer=tokenizer, **sampling)
    push(transfer, tiny_model, version=0)
    worker = start_worker(tiny_model, tokenizer, transfer, generator_options=options, stop=stop, dataset=prompts(2))
    try:
        groups = collect_groups(worker, 2)
        clipped, rollouts = drained_rate(worker, "completions/clipped_ratio")
    finally:
        worker.stop()
    check_stopped_samples(groups, tiny_model, tokenizer, stop, MAX_TOKENS, **sampling)
    samples = [sample for samples in groups.values() for sample in samples]
    assert rollouts == len(samples) and clipped == sum(sample.truncated for sample in samples)  # stops are not clipped


@pytest.mark.timeout(240)
def test_children_are_forked_by_one_preloading_server_with_the_environment_of_their_start(
    tiny_model, tokenizer, transfer, monkeypatch, no_leaked_processes
):
    """Two children in a row: both forked by the same forkserver (which exits with this process, so it is no leak),
    each with this process's environment as it was when that child started, down to its reward worker."""
    push(transfer, tiny_model, version=0)
    servers, marks = [], []
    for mark in ("7", "8"):
        monkeypatch.setenv("LIGHTNING_GRPO_TEST_MARK", mark)  # not read at import: a forked child sees the new value
        worker = start_worker(tiny_model, tokenizer, transfer, reward_funcs=[environment_mark], dataset=prompts(1))
        try:
            servers.append(psutil.Process(worker.pid).ppid())
            (samples,) = collect_groups(worker, 1).values()
            marks.append({int(s.metrics["rewards/environment_mark"]) for s in samples})
        finally:
            worker.stop()
    assert servers[0] == servers[1] == start_method._server["pid"] != os.getpid()
    assert "multiprocessing.forkserver" in " ".join(psutil.Process(servers[0]).cmdline())
    assert marks == [{7}, {8}]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("set_by_user", [None, "64"])
def test_the_child_bounds_its_kernel_caches_unless_the_user_sized_them(
    tiny_model, tokenizer, transfer, monkeypatch, set_by_user, no_leaked_processes
):
    """oneDNN's kernel cache is capped in the rollout child (and the processes it starts) before its first product;
    a capacity the user set is kept."""
    if set_by_user is None:
        monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", set_by_user)
    push(transfer, tiny_model, version=0)
    worker = start_worker(tiny_model, tokenizer, transfer, reward_funcs=[kernel_cache_capacity], dataset=prompts(1))
    try:
        (samples,) = collect_groups(worker, 1).values()
    finally:
        worker.stop()
    expected = int(set_by_user or start_method.KERNEL_CACHE_CAPACITY)
    assert {int(s.metrics["rewards/kernel_cache_capacity"]) for s in samples} == {expected}


def test_a_changed_import_time_variable_or_the_switch_spawns_the_child(monkeypatch):
    """A variable torch or transformers read when the server imported them cannot reach a forked child: spawn."""
    start_method.warm_up()  # returns once the server has imported the loop (it forked and reaped a no-op child)
    server = psutil.Process(start_method._server["pid"])
    assert server.ppid() == os.getpid() and "lightning_grpo.rollout.loop" in " ".join(server.cmdline())
    assert start_method.rollout_context().get_start_method() == "forkserver"
    monkeypatch.setenv("HF_LIGHTNING_GRPO_TEST", "1")
    assert start_method.rollout_context().get_start_method() == "spawn"
    monkeypatch.delenv("HF_LIGHTNING_GRPO_TEST")
    assert start_method.rollout_context().get_start_method() == "forkserver"
    monkeypatch.setenv(start_method.ENV_SWITCH, "spawn")
    assert start_method.rollout_context().get_start_method() == "spawn"
