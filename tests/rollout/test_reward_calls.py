"""Rewards that run inside the rollout process (`async def` ones, and synchronous ones with `reward_num_workers=0`)
follow the reward pool's rules: a call that raises, hangs or returns a bad value scores NaN, is logged once and is
counted in the pool's metrics, and the calls after it score as usual. A hang is shown by the reward's own state (it
marks when it started, and a cancelled one when it was cancelled), never by a wall-clock window."""

from __future__ import annotations

import asyncio
import logging
import math
import threading

import pytest

from lightning_grpo.rollout.reward_calls import COUNTERS, InlineRewards

LOGGER = "lightning_grpo.rollout.reward_calls"


def all_nan(values: list[float]) -> bool:
    return bool(values) and all(math.isnan(v) for v in values)


def lengths(completions, **kwargs):
    return [float(len(c)) for c in completions]


def raises(completions, **kwargs):
    raise ValueError(f"cannot score {len(completions)} completions")


def returns_text(completions, **kwargs):
    return "not a list of rewards"


async def async_lengths(completions, **kwargs):
    await asyncio.sleep(0)
    return [float(len(c)) for c in completions]


async def async_raises(completions, **kwargs):
    await asyncio.sleep(0)
    raise RuntimeError("async reward raised on cue")


class AsyncHang:
    """An async reward that marks its start, then awaits forever; records whether it was cancelled."""

    __name__ = "async_hang"

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.cancelled = False

    async def __call__(self, completions, **kwargs):
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise


class ThreadHang:
    """A synchronous reward that marks its start, then blocks until released (a thread cannot be killed)."""

    __name__ = "thread_hang"

    def __init__(self) -> None:
        self.started = threading.Semaphore(0)
        self.release = threading.Event()
        self.finished = 0

    def __call__(self, completions, **kwargs):
        self.started.release()
        self.release.wait()
        self.finished += 1
        return [1.0] * len(completions)


def score(inline: InlineRewards, index: int, func, completions: list[str], *, is_async: bool) -> list[float]:
    return asyncio.run(inline.score(index, func, {"completions": completions}, is_async=is_async))


def records(caplog, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and text in r.getMessage()]


@pytest.mark.parametrize(
    ("is_async", "error"),
    [(False, "ValueError: cannot score 2 completions"), (True, "RuntimeError: async reward raised on cue")],
    ids=["thread", "async"],
)
def test_reward_fn_raises_scores_nan_is_counted_logged_once_and_the_next_call_scores(caplog, is_async, error):
    funcs = [async_raises, async_lengths] if is_async else [raises, lengths]
    inline = InlineRewards([f.__name__ for f in funcs], timeout=60)
    for _ in range(3):
        assert all_nan(score(inline, 0, funcs[0], ["a", "b"], is_async=is_async))
    assert score(inline, 1, funcs[1], ["abc"], is_async=is_async) == [3.0]
    stats = inline.stats()
    assert set(stats) == {f"reward_pool/{name}" for name in COUNTERS}  # the pool's metric names
    assert stats["reward_pool/errors_total"] == 3.0 and stats["reward_pool/calls_total"] == 4.0
    assert stats["reward_pool/timeouts_total"] == 0.0
    [record] = records(caplog, f"{funcs[0].__name__!r} failed, its rewards for this call are NaN")
    assert record.levelno == logging.ERROR and error in record.getMessage()
    assert "Traceback" in record.getMessage() and f"in {funcs[0].__name__}" in record.getMessage()


def test_a_wrong_return_value_scores_nan_and_names_what_was_expected(caplog):
    inline = InlineRewards(["returns_text"], timeout=60)
    assert all_nan(score(inline, 0, returns_text, ["a", "b"], is_async=False))
    assert inline.stats()["reward_pool/errors_total"] == 1.0
    [record] = records(caplog, "'returns_text' failed")
    assert "expected a list of 2 floats" in record.getMessage()


def test_hung_async_reward_is_cancelled_at_the_timeout_scores_nan_and_the_next_call_scores(caplog):
    hang = AsyncHang()
    inline = InlineRewards(["async_hang", "async_lengths"], timeout=0.5)

    async def main() -> tuple[list[float], list[float]]:
        hung = asyncio.create_task(inline.score(0, hang, {"completions": ["a", "b"]}, is_async=True))
        await hang.started.wait()  # it runs, and stays pending past the timeout ...
        rewards = await hung
        await asyncio.sleep(0)  # ... then its cancellation is delivered
        return rewards, await inline.score(1, async_lengths, {"completions": ["abc"]}, is_async=True)

    hung, after = asyncio.run(main())
    assert all_nan(hung) and after == [3.0]
    assert hang.cancelled
    stats = inline.stats()
    assert stats["reward_pool/timeouts_total"] == 1.0 and stats["reward_pool/errors_total"] == 0.0
    assert records(caplog, "'async_hang' ran longer than timeout=0.5 s; it was cancelled")


def test_hung_thread_rewards_score_nan_and_never_starve_the_calls_after_them(caplog):
    """More hung calls than a default thread pool has threads (min(32, cores + 4)): each scores NaN at its timeout,
    and a call after them still runs at once on a thread of its own; the hung threads are daemons, and their late
    results are ignored once released."""
    hang = ThreadHang()
    inline = InlineRewards(["thread_hang", "lengths"], timeout=0.5)
    hung_calls = 40

    async def main() -> tuple[list[list[float]], list[float]]:
        hung = await asyncio.gather(
            *(inline.score(0, hang, {"completions": ["a"]}, is_async=False) for _ in range(hung_calls))
        )
        return hung, await inline.score(1, lengths, {"completions": ["abcd"]}, is_async=False)

    try:
        hung, after = asyncio.run(main())
        for _ in range(hung_calls):
            assert hang.started.acquire(timeout=60)  # every hung call had started: it hung, it did not queue
        assert all(map(all_nan, hung)) and after == [4.0]
        threads = [t for t in threading.enumerate() if t.name == "reward-thread_hang"]
        assert len(threads) == hung_calls and all(t.daemon for t in threads)
        stats = inline.stats()
        assert stats["reward_pool/timeouts_total"] == hung_calls and stats["reward_pool/calls_total"] == hung_calls + 1
        [record] = records(caplog, "'thread_hang' ran longer than timeout=0.5 s; its thread cannot be stopped")
        assert record.levelno == logging.WARNING
    finally:
        hang.release.set()
    for thread in threads:
        thread.join(timeout=60)
    assert hang.finished == hung_calls  # released, they ended; their results went nowhere
