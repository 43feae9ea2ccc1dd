"""RewardProcessPool with real worker processes: results, every fault rule, shutdown and process hygiene.

Reward functions of this module are shipped to workers by value (as a notebook cell's would be), so workers never
import the test module.
"""

from __future__ import annotations

import asyncio
import ctypes
import importlib
import logging
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import wait

import cloudpickle
import psutil
import pytest
from helpers.processes import live_children

from lightning_grpo.rewards import accuracy, boxed_format
from lightning_grpo.rollout.reward_pool import RewardProcessPool

cloudpickle.register_pickle_by_value(sys.modules[__name__])

POISON = "\\boxed{9^{9^{9^{9}}}}"
GOOD = "7 + 5 = 12\n\nThe answer is \\boxed{12}."
LOGGER = "lightning_grpo.rollout.reward_pool"


def lengths(completions, **kwargs):
    return [len(c) for c in completions]


def none_for_empty(completions, **kwargs):
    return [None if not c else 1 for c in completions]


def raises(completions, **kwargs):
    raise ValueError(f"cannot score {len(completions)} completions")


def blocks_until_released(completions, marker, release="", **kwargs):
    """Creates `marker` (the call has started on a worker), then blocks until the file `release` exists."""
    open(marker, "w").close()
    while not (release and os.path.exists(release)):
        time.sleep(0.02)
    return [1.0] * len(completions)


def marks_then_accuracy(completions, answer, marker, **kwargs):
    """`accuracy`, after creating `marker` (the call has started on a worker)."""
    open(marker, "w").close()
    return accuracy(completions, answer)


def wait_for_file(path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def dies_once(completions, marker, how, **kwargs):
    """Kills its own worker the first time (no marker file yet), scores normally on the retry."""
    if not os.path.exists(marker):
        open(marker, "w").close()
        _die(how)
    return [2.0] * len(completions)


def always_dies(completions, how, **kwargs):
    _die(how)


def _die(how):
    if how == "exit":
        os._exit(7)
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    ctypes.string_at(0)  # segfault


def returns(completions, value, **kwargs):
    return value


def records_order(completions, path, **kwargs):
    with open(path, "a") as f:
        f.write(f"{completions[0]}\n")
    return [0.0] * len(completions)


class LoadsNowhere:
    """A reward function whose pickle needs a module that does not exist in the worker."""

    def __call__(self, completions, **kwargs):
        return [1.0] * len(completions)

    def __reduce__(self):
        return importlib.import_module, ("lightning_grpo_no_such_module",)


def all_nan(values):
    return bool(values) and all(math.isnan(v) for v in values)


def error_records(caplog, text):
    return [r for r in caplog.records if r.name == LOGGER and text in r.getMessage()]


@pytest.mark.timeout(60)
def test_rewards_come_back_as_floats_with_none_as_nan(no_leaked_processes):
    with RewardProcessPool([lengths, none_for_empty, accuracy, boxed_format], num_workers=2, timeout=30) as pool:
        assert pool.submit(0, completions=["a", "bbb"]).result(timeout=30) == [1.0, 3.0]
        got = pool.submit(1, completions=["x", ""]).result(timeout=30)
        assert got[0] == 1.0 and math.isnan(got[1])
        chats = [[{"role": "assistant", "content": GOOD}], [{"role": "assistant", "content": "13"}]]
        assert pool.submit(2, completions=chats, answer=["12", "12"]).result(timeout=30) == [1.0, 0.0]
        assert pool.submit(3, completions=[GOOD, "12"]).result(timeout=30) == [1.0, 0.0]
        assert pool.submit(0, completions=[]).result(timeout=1) == []
        stats = pool.stats()
    assert stats["reward_pool/calls_total"] == 4.0
    assert stats["reward_pool/errors_total"] == stats["reward_pool/timeouts_total"] == 0.0
    assert stats["reward_pool/restarts_total"] == 0.0
    assert stats["reward_pool/busy_s"] > 0.0


@pytest.mark.timeout(60)
def test_reward_fn_raises_scores_nan_and_run_continues(no_leaked_processes, caplog):
    with RewardProcessPool([raises, lengths], num_workers=1, timeout=30) as pool:
        assert all_nan(pool.submit(0, completions=["a", "b"]).result(timeout=30))
        assert pool.submit(1, completions=["abc"]).result(timeout=30) == [3.0]
        stats = pool.stats()
    assert stats["reward_pool/errors_total"] == 1.0
    assert stats["reward_pool/restarts_total"] == 0.0  # an exception does not cost the worker
    [record] = error_records(caplog, "'raises' failed")
    assert record.levelno == logging.ERROR
    assert "ValueError: cannot score 2 completions" in record.getMessage()
    assert "Traceback" in record.getMessage() and "in raises" in record.getMessage()


@pytest.mark.timeout(60)
def test_identical_errors_are_logged_once_then_counted(no_leaked_processes, caplog):
    with RewardProcessPool([raises], num_workers=2, timeout=30) as pool:
        futures = [pool.submit(0, completions=["a"] * (i + 1)) for i in range(5)]
        assert all(all_nan(f.result(timeout=30)) for f in futures)
        assert pool.stats()["reward_pool/errors_total"] == 5.0
        assert len(error_records(caplog, "'raises' failed")) == 1
    summaries = error_records(caplog, "repeated 4 more times")
    assert len(summaries) == 1 and "Traceback" not in summaries[0].getMessage()


def test_repeated_errors_are_summarised_periodically(caplog):
    from lightning_grpo.rollout.reward_calls import ErrorLog

    errors = ErrorLog(interval_s=0.0, logger=logging.getLogger(LOGGER))
    caplog.set_level(logging.WARNING, logger=LOGGER)
    for _ in range(3):
        errors.report(("f", "error", "site"), logging.ERROR, "f failed", "Traceback: ...")
    errors.flush()
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["f failed\nTraceback: ...", *["f failed (repeated 1 more times in the last 0 s)"] * 2]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ([1.0], "expected a list of 2 floats"),
        ("ab", "expected a list of 2 floats"),
        (None, "expected a list of 2 floats"),
        ([1.0, "0.5"], "holds '0.5'"),
    ],
)
def test_wrong_return_value_is_an_error_naming_the_function(no_leaked_processes, caplog, value, problem):
    with RewardProcessPool([returns], num_workers=1, timeout=30) as pool:
        assert all_nan(pool.submit(0, completions=["a", "b"], value=value).result(timeout=30))
        assert pool.stats()["reward_pool/errors_total"] == 1.0
    [record] = error_records(caplog, "'returns' failed")
    assert problem in record.getMessage() and repr(value)[:10] in record.getMessage()


@pytest.mark.timeout(120)
def test_poison_completion_times_out_to_nan_while_other_calls_flow(no_leaked_processes, caplog, tmp_path):
    """A completion that hangs `accuracy` in C code (math_verify's own alarm cannot end it) holds one worker until
    the pool's timeout kills it; the calls submitted once it had started all finish on the other worker before it
    does. Shown by the order the calls finished in, not by their times."""
    marker, answers, finished = str(tmp_path / "poisoned"), ["12"] * 8, []
    with RewardProcessPool([accuracy, marks_then_accuracy, lengths], num_workers=2, timeout=3) as pool:
        poisoned = pool.submit(1, completions=[GOOD] * 7 + [POISON], answer=answers, marker=marker)
        poisoned.add_done_callback(lambda _: finished.append("poisoned"))
        wait_for_file(marker)  # a worker took it
        others = [pool.submit(2, completions=["ab", "c"]) for _ in range(10)]
        for future in others:
            future.add_done_callback(lambda _: finished.append("other"))
        assert [future.result(timeout=60) for future in others] == [[2.0, 1.0]] * 10
        assert all_nan(poisoned.result(timeout=60))
        assert finished == ["other"] * 10 + ["poisoned"]  # the other calls finished while the poisoned one was stuck
        # the respawned worker scores again
        assert pool.submit(0, completions=[GOOD] * 8, answer=answers).result(timeout=60) == [1.0] * 8
        stats = pool.stats()
    assert stats["reward_pool/timeouts_total"] == 1.0
    assert stats["reward_pool/restarts_total"] == 1.0
    assert stats["reward_pool/errors_total"] == 0.0
    assert stats["reward_pool/calls_total"] == 12.0
    assert error_records(caplog, "'marks_then_accuracy' ran longer than timeout=3 s")


@pytest.mark.timeout(120)
def test_event_loop_keeps_running_while_poison_call_is_pending(no_leaked_processes, tmp_path):
    """`score` awaits a worker without blocking the event loop: the loop runs on while the call is in a worker
    (started, not finished). A frozen loop would not run at all until the call ended."""
    marker = tmp_path / "started"

    async def main(pool):
        call = asyncio.ensure_future(pool.score(0, completions=[POISON], answer=["12"], marker=str(marker)))
        ticks_while_running = 0
        while not call.done():
            ticks_while_running += marker.exists()
            await asyncio.sleep(0.05)
        return await call, ticks_while_running

    with RewardProcessPool([marks_then_accuracy], num_workers=1, timeout=2) as pool:
        rewards, ticks = asyncio.run(main(pool))
    assert all_nan(rewards)
    assert ticks >= 3


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["exit", "sigkill", "segfault"])
def test_worker_killing_itself_is_respawned_and_call_retried_once(no_leaked_processes, caplog, tmp_path, how):
    marker = str(tmp_path / "died")
    with RewardProcessPool([dies_once, lengths], num_workers=1, timeout=30) as pool:
        assert pool.submit(0, completions=["a", "b"], marker=marker, how=how).result(timeout=30) == [2.0, 2.0]
        assert pool.submit(1, completions=["abc"]).result(timeout=30) == [3.0]
        stats = pool.stats()
    assert stats["reward_pool/restarts_total"] == 1.0
    assert stats["reward_pool/errors_total"] == 0.0
    [record] = error_records(caplog, "'dies_once' killed its worker process")
    assert "retried on a new worker" in record.getMessage()
    status = {"exit": "exit code 7", "sigkill": "SIGKILL", "segfault": "SIGSEGV"}[how]
    assert status in record.getMessage()


@pytest.mark.timeout(60)
def test_worker_dying_again_on_the_retry_scores_nan(no_leaked_processes, caplog):
    with RewardProcessPool([always_dies, lengths], num_workers=1, timeout=30) as pool:
        assert all_nan(pool.submit(0, completions=["a", "b"], how="exit").result(timeout=30))
        assert pool.submit(1, completions=["abc"]).result(timeout=30) == [3.0]
        stats = pool.stats()
    assert stats["reward_pool/restarts_total"] == 2.0
    assert stats["reward_pool/errors_total"] == 1.0
    [record] = error_records(caplog, "'always_dies' killed its worker process")
    assert record.levelno == logging.ERROR and "again on the retry" in record.getMessage()


@pytest.mark.timeout(60)
def test_lambda_defined_in_test_is_shipped_with_cloudpickle(no_leaked_processes):
    bonus = 0.5  # captured by the closure: shipped by value

    def local_reward(completions, **kwargs):
        return [bonus + len(c) for c in completions]

    funcs = [lambda completions, **kwargs: [bonus] * len(completions), local_reward]
    with RewardProcessPool(funcs, num_workers=1, timeout=30) as pool:
        assert pool.reward_func_names == ["<lambda>", "local_reward"]
        assert pool.submit(0, completions=["a", "b"]).result(timeout=30) == [0.5, 0.5]
        assert pool.submit(1, completions=["abc"]).result(timeout=30) == [3.5]


@pytest.mark.timeout(60)
def test_more_calls_than_workers_run_in_fifo_order(no_leaked_processes, tmp_path):
    path = str(tmp_path / "order")
    with RewardProcessPool([records_order], num_workers=1, timeout=30) as pool:
        futures = [pool.submit(0, completions=[f"call{i}"], path=path) for i in range(8)]
        wait(futures, timeout=30)
    with open(path) as f:
        assert f.read().split() == [f"call{i}" for i in range(8)]


@pytest.mark.timeout(60)
def test_cancelled_queued_call_never_runs(no_leaked_processes, tmp_path):
    path, marker, release = str(tmp_path / "order"), str(tmp_path / "busy"), str(tmp_path / "release")
    with RewardProcessPool([blocks_until_released, records_order], num_workers=1, timeout=30) as pool:
        busy = pool.submit(0, completions=["a"], marker=marker, release=release)
        wait_for_file(marker)  # the only worker is busy until released: the next call stays queued
        skipped = pool.submit(1, completions=["skipped"], path=path)
        assert skipped.cancel()
        open(release, "w").close()
        assert pool.submit(1, completions=["ran"], path=path).result(timeout=30) == [0.0]
        assert busy.result(timeout=30) == [1.0]
    with open(path) as f:
        assert f.read().split() == ["ran"]


@pytest.mark.timeout(60)
def test_close_leaves_no_child_process(no_leaked_processes, tmp_path):
    """`close` kills the workers without waiting for a call that would never end, and resolves every call NaN."""
    before = {p.pid for p in live_children()}
    marker = str(tmp_path / "running")
    pool = RewardProcessPool([blocks_until_released], num_workers=3, timeout=30)
    workers = [p for p in live_children() if p.pid not in before]
    assert len(workers) == 3
    running = pool.submit(0, completions=["a"], marker=marker)  # never released
    queued = [pool.submit(0, completions=["a", "b"], marker=str(tmp_path / f"q{i}")) for i in range(4)]
    wait_for_file(marker)
    pool.close()  # returns although the running call never ends (the test's timeout catches a wait)
    pool.close()  # idempotent
    assert all(not p.is_running() or p.status() == psutil.STATUS_ZOMBIE for p in workers)
    assert not [p for p in live_children() if p.pid not in before]
    for future in [running, *queued]:
        assert all_nan(future.result(timeout=1))
    assert pool.stats()["reward_pool/calls_total"] == 0.0  # calls cut short by close are not counted
    assert not [t for t in threading.enumerate() if t.name.startswith("reward-pool-")]
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(0, completions=["a"], marker=marker)


@pytest.mark.timeout(60)
def test_garbage_collected_pool_stops_its_workers(no_leaked_processes):
    pool = RewardProcessPool([lengths], num_workers=2, timeout=30)
    assert pool.submit(0, completions=["ab"]).result(timeout=30) == [2.0]
    del pool  # the finalizer closes it; the leak check fails otherwise


@pytest.mark.timeout(60)
def test_workers_die_when_the_pool_owner_is_sigkilled(no_leaked_processes):
    # The owner is a separate process, so it can be SIGKILLed; one of its workers is busy in a long call.
    script = textwrap.dedent(
        """
        import sys, time
        from lightning_grpo.rollout.reward_pool import RewardProcessPool
        def sleeps(completions, **kwargs):
            time.sleep(60)
        pool = RewardProcessPool([sleeps], num_workers=2, timeout=120)
        pool.submit(0, completions=["a"])
        print("ready", flush=True)
        time.sleep(60)
        """
    )
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "ready"
        workers = psutil.Process(owner.pid).children()
        assert len(workers) == 2
    finally:
        owner.kill()
        owner.wait()
    gone, alive = psutil.wait_procs(workers, timeout=30)
    for orphan in alive:
        orphan.kill()
    assert not alive, f"workers outlived their owner: {alive}"


def test_constructor_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"reward_funcs=\[\]"):
        RewardProcessPool([], num_workers=1)
    with pytest.raises(ValueError, match=r"num_workers=0\)` must be an int >= 1.*timeout=0\)"):
        RewardProcessPool([lengths], num_workers=0, timeout=0)
    with pytest.raises(ValueError, match=r"timeout=inf"):
        RewardProcessPool([lengths], num_workers=1, timeout=float("inf"))
    with pytest.raises(TypeError, match="entry 1 is 'text', which is not callable"):
        RewardProcessPool([lengths, "text"], num_workers=1)


def test_function_that_cloudpickle_cannot_ship_is_a_type_error_naming_it():
    lock = threading.Lock()

    def holds_lock(completions, **kwargs):
        with lock:
            return [1.0] * len(completions)

    with pytest.raises(TypeError, match="cannot send reward function 'holds_lock'"):
        RewardProcessPool([lengths, holds_lock], num_workers=1)


@pytest.mark.timeout(60)
def test_function_that_cannot_load_in_a_worker_fails_at_construction(no_leaked_processes):
    with pytest.raises(RuntimeError, match="'LoadsNowhere' cannot be loaded in a worker.*lightning_grpo_no_such"):
        RewardProcessPool([lengths, LoadsNowhere()], num_workers=2)


@pytest.mark.timeout(60)
def test_async_function_keeps_its_index_but_cannot_be_submitted(no_leaked_processes):
    lock = threading.Lock()  # unpicklable: async functions are never shipped

    async def async_reward(completions, **kwargs):
        with lock:
            return [1.0] * len(completions)

    with RewardProcessPool([async_reward, lengths], num_workers=1, timeout=30) as pool:
        with pytest.raises(TypeError, match="'async_reward' is async; await it"):
            pool.submit(0, completions=["a"])
        assert pool.submit(1, completions=["abc"]).result(timeout=30) == [3.0]


@pytest.mark.timeout(90)
def test_pool_runs_inside_a_daemonic_spawned_process(no_leaked_processes, tmp_path):
    # The rollout child is a daemonic spawned process, and multiprocessing forbids children of daemons. The
    # daemon's parent is a script of its own, so that multiprocessing's resource tracker ends with it.
    script = tmp_path / "owner.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import multiprocessing
            from lightning_grpo.rollout.reward_pool import RewardProcessPool
            from lightning_grpo.rewards import accuracy

            def score(queue):
                with RewardProcessPool([accuracy], num_workers=1, timeout=30) as pool:
                    queue.put(pool.submit(0, completions=[{GOOD!r}, "13"], answer=["12", "12"]).result(timeout=30))

            if __name__ == "__main__":
                ctx = multiprocessing.get_context("spawn")
                queue = ctx.Queue()
                child = ctx.Process(target=score, args=(queue,), daemon=True)
                child.start()
                print(queue.get(timeout=60))
                child.join(timeout=30)
                print(child.exitcode)
            """
        )
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=80)
    assert done.stdout.split("\n")[:2] == ["[1.0, 0.0]", "0"], done.stderr


@pytest.mark.timeout(60)
def test_submit_rejects_bad_index_missing_completions_and_unpicklable_kwargs(no_leaked_processes):
    with RewardProcessPool([lengths, boxed_format], num_workers=1, timeout=30) as pool:
        for index in (2, -1, "0", True):
            with pytest.raises(ValueError, match=rf"index={index!r}\) is not a reward function"):
                pool.submit(index, completions=["a"])
        with pytest.raises(ValueError, match="needs `completions=`"):
            pool.submit(0, prompts=["a"])
        with pytest.raises(TypeError, match="cannot send the arguments of reward function 'lengths'"):
            pool.submit(0, completions=["a"], lock=threading.Lock())
        # `index` is positional-only, so a dataset column may be called "index"
        assert pool.submit(0, completions=["ab"], index=[3]).result(timeout=30) == [2.0]
        assert pool.stats()["reward_pool/calls_total"] == 1.0
