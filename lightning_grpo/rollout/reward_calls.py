"""Reward calls that run inside the rollout process, under the reward pool's rules: `async def` rewards on its event
loop, and synchronous ones in threads when `reward_num_workers=0`. Also the counters and the error log that the pool
and these calls share, so a fault is counted in the same metrics wherever its reward ran.

This module imports only the standard library and `reward_results` (never torch or Lightning).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .reward_results import Outcome, run_reward

log = logging.getLogger(__name__)

#: Identical errors from one function are logged in full once, then as a count at most this often.
ERROR_SUMMARY_INTERVAL_S = 60.0
#: The counters, as `reward_pool/<name>` in the metrics.
COUNTERS = ("calls_total", "errors_total", "timeouts_total", "restarts_total", "busy_s")


class RewardStats:
    """Thread-safe reward-call counters: `reward_pool/{calls,errors,timeouts,restarts}_total` and `reward_pool/busy_s`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(COUNTERS, 0.0)

    def add(self, **increments: float) -> None:
        with self._lock:
            for key, value in increments.items():
                self._values[key] += value

    def as_dict(self) -> dict[str, float]:
        with self._lock:
            return {f"reward_pool/{key}": float(value) for key, value in self._values.items()}


@dataclass(slots=True)
class _Seen:
    """A failure already logged in full: how often it repeated since it was last logged."""

    level: int
    message: str  # the latest occurrence's message
    logged_at: float  # time.monotonic() of the last log line
    repeats: int = 0


class ErrorLog:
    """Logs the first occurrence of each distinct failure in full, then repeats as a count at most once a minute.

    Args:
        interval_s: the least time between two log lines of one failure.
        logger: where the lines go.
    """

    def __init__(self, interval_s: float = ERROR_SUMMARY_INTERVAL_S, logger: logging.Logger = log) -> None:
        self._interval_s = interval_s
        self._log = logger
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, ...], _Seen] = {}

    def report(self, key: tuple[str, ...], level: int, message: str, details: str = "") -> None:
        now = time.monotonic()
        with self._lock:
            seen = self._seen.get(key)
            if seen is None:
                self._seen[key] = _Seen(level, message, now)
            else:
                seen.repeats, seen.message = seen.repeats + 1, message
                if now - seen.logged_at < self._interval_s:
                    return
                repeats, since = seen.repeats, seen.logged_at
                seen.repeats, seen.logged_at = 0, now
        if seen is None:
            self._log.log(level, f"{message}\n{details}" if details else message)
        else:
            self._log.log(level, "%s (repeated %d more times in the last %.0f s)", message, repeats, now - since)

    def flush(self) -> None:
        """Logs the repeats not logged yet (when the pool closes)."""
        with self._lock:
            pending = [(seen.level, seen.message, seen.repeats) for seen in self._seen.values() if seen.repeats]
            for seen in self._seen.values():
                seen.repeats = 0
        for level, message, repeats in pending:
            self._log.log(level, "%s (repeated %d more times before the pool closed)", message, repeats)


def report_failure(errors: ErrorLog, name: str, kind: str, message: str, site: str = "", details: str = "") -> None:
    """Log a failed call of reward `name` as the pool does: `kind` is "error" (raised or returned a bad value; `site`
    groups identical errors) or "timeout" (`message` then says what became of the call)."""
    if kind == "timeout":
        errors.report((name, "timeout"), logging.WARNING, f"Reward function {name!r} {message}")
    else:
        text = f"Reward function {name!r} failed, its rewards for this call are NaN: {message}"
        errors.report((name, "error", site), logging.ERROR, text, details)


class InlineRewards:
    """Runs the reward calls that stay in the rollout process, with the pool's rules.

    - **`async def` rewards** are awaited on the rollout loop's event loop, each call bounded by `timeout`: one that
      is still pending then is cancelled. An async reward that blocks (`time.sleep`, CPU work) instead of awaiting
      stops the whole event loop while it runs; no timeout can end that (the rollout child's heartbeat stops, and
      the run fails after `heartbeat_timeout`). Give such work to a synchronous reward, which runs in the pool.
    - **synchronous rewards with `reward_num_workers=0`** run each call in a thread of its own, bounded by
      `timeout`. A thread cannot be killed: one still running then is left to finish (a daemon thread, so it never
      holds up the process's exit) and its result is ignored. A reward that can hang belongs in the pool, whose
      workers are killed and replaced.

    Either way, a call that raises, returns something other than one number (or `None`) per completion, or runs past
    `timeout` scores NaN, is logged once (identical repeats as a periodic count) and counted like a pool call
    (`reward_pool/errors_total`, `reward_pool/timeouts_total`, `reward_pool/calls_total`, `reward_pool/busy_s`); the
    run goes on.

    Args:
        names: the reward functions' names, by index (the reward columns').
        timeout: wall-clock seconds one call may take.
    """

    def __init__(self, names: Sequence[str], timeout: float) -> None:
        self.names = list(names)
        self.timeout = float(timeout)
        self.errors = ErrorLog()
        self._stats = RewardStats()

    def stats(self) -> dict[str, float]:
        """The counters since start (`RewardProcessPool.stats`' names)."""
        return self._stats.as_dict()

    async def score(
        self, index: int, func: Callable[..., Any], kwargs: dict[str, Any], *, is_async: bool
    ) -> list[float]:
        """Reward `index` (`func`) on one group's `kwargs`: one float per completion, NaN where not scored."""
        size = len(kwargs["completions"])
        started = time.monotonic()
        if is_async:
            kind, rewards, message, site, details = await self._awaited(func, kwargs, size)
        else:
            kind, rewards, message, site, details = await self._threaded(self.names[index], func, kwargs, size)
        if kind != "ok":
            report_failure(self.errors, self.names[index], kind, message, site, details)
        self._stats.add(
            calls_total=1.0,
            errors_total=float(kind == "error"),
            timeouts_total=float(kind == "timeout"),
            busy_s=time.monotonic() - started,
        )
        return rewards if kind == "ok" and rewards is not None else [math.nan] * size

    async def _awaited(self, func: Callable[..., Any], kwargs: dict[str, Any], size: int) -> Outcome:
        task = asyncio.ensure_future(_awaiting(func, kwargs))
        try:
            done, _ = await asyncio.wait({task}, timeout=self.timeout)
        except asyncio.CancelledError:  # the rollout loop is stopping
            task.cancel()
            raise
        if not done:
            task.cancel()  # not awaited: a reward that swallows the cancellation must not hold the loop's scoring
            task.add_done_callback(_retrieve)
            message = f"ran longer than timeout={self.timeout:g} s; it was cancelled and the call's rewards are NaN."
            return "timeout", None, message, "", ""
        return run_reward(task.result, size)

    async def _threaded(self, name: str, func: Callable[..., Any], kwargs: dict[str, Any], size: int) -> Outcome:
        loop = asyncio.get_running_loop()
        reply: asyncio.Future = loop.create_future()

        def call() -> None:
            outcome = run_reward(lambda: func(**kwargs), size)
            with contextlib.suppress(RuntimeError):  # the loop closed while the call ran on
                loop.call_soon_threadsafe(_resolve, reply, outcome)

        threading.Thread(target=call, name=f"reward-{name}", daemon=True).start()
        done, _ = await asyncio.wait({reply}, timeout=self.timeout)
        if not done:
            reply.cancel()
            message = (
                f"ran longer than timeout={self.timeout:g} s; its thread cannot be stopped and runs on, its result "
                "ignored, and the call's rewards are NaN (reward_num_workers >= 1 runs rewards in processes that a "
                "stuck call is killed with)."
            )
            return "timeout", None, message, "", ""
        return reply.result()


def _resolve(future: asyncio.Future, outcome: Outcome) -> None:
    if not future.done():
        future.set_result(outcome)


def _retrieve(task: asyncio.Task) -> None:
    """Reads a cancelled call's end, so that asyncio does not log it as never retrieved."""
    if not task.cancelled():
        task.exception()


async def _awaiting(func: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    """The call inside the task, so that one raising before it returns its awaitable fails the task too."""
    return await func(**kwargs)
