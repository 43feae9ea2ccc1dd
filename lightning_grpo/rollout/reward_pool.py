"""Long-lived worker processes that run synchronous reward functions, with a wall-clock timeout per call.

This module imports only the standard library and cloudpickle: each worker is a fresh interpreter that imports this
module (and whatever the reward functions import), never torch or Lightning.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import math
import multiprocessing
import numbers
import os
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from functools import partial
from multiprocessing.connection import Connection
from typing import Any

import cloudpickle

from .lifetime import exit_status
from .reward_calls import ErrorLog, RewardStats, report_failure

log = logging.getLogger(__name__)

_NAN = float("nan")
#: Seconds a new worker may take to start and load the reward functions.
STARTUP_TIMEOUT_S = 120.0
#: How often a waiting thread re-checks that its worker is alive and the pool is open.
_POLL_S = 0.5
# The worker is a fresh interpreter started with the parent's sys.path, so it imports this module and nothing else
# (multiprocessing's spawn would also re-run the parent's `__main__`, e.g. a training script importing torch).
_BOOT = (
    "import sys; sys.path[:] = sys.argv[3:]; "
    "from lightning_grpo.rollout.reward_worker import worker_main; worker_main(sys.argv[1:3])"
)


class RewardProcessPool:
    """Long-lived processes that run synchronous reward functions.

    Each call runs one reward function on one group of completions, on a worker's **main thread**, so CPU-bound
    rewards scale past the GIL and `signal.alarm` timeouts (math_verify) stay enabled; TRL's default
    `asyncio.to_thread` has to switch them off, and a function stuck in C code holding the GIL freezes TRL's whole
    rollout loop. Here a stuck call is bounded by `timeout`.

    What happens when a reward function misbehaves (the run always goes on):

    - **raises**, or returns something other than one number (or `None`) per completion: that call's rewards are
      NaN (not scored); the error is logged once with its traceback (identical repeats as a periodic count) and
      counted in `reward_pool/errors_total`.
    - **runs longer than** `timeout` **seconds** (wall clock, from when a worker takes the call): the worker is
      killed (SIGKILL) and respawned, the call's rewards are NaN, counted in `reward_pool/timeouts_total`.
    - **kills its worker** (`os._exit`, a segfault, SIGKILL, out of memory): the worker is respawned and the call
      retried once on it; if the worker dies again the call's rewards are NaN and it counts as an error.

    Every worker lost (killed or died) counts in `reward_pool/restarts_total`. Calls beyond the number of idle workers wait in FIFO
    order. Workers are fresh interpreters (not forks) started with this process's `sys.path`; each receives the
    reward functions once, serialized with cloudpickle, so lambdas and functions defined in a notebook cell work.
    Workers die with this process, even when it is SIGKILLed. `None` rewards become NaN.

    Args:
        reward_funcs: Functions with TRL's reward signature,
            `f(completions, prompts, completion_ids, **dataset_columns) -> list[float | None]`, one entry per
            completion; each must be serializable with cloudpickle. Async functions may be listed, so that indices
            match the caller's reward columns, but are not shipped and cannot be submitted.
        num_workers: Number of worker processes, each running one call at a time.
        timeout: Wall-clock limit in seconds for one call. Keep it above the function's own limits (math_verify:
            5 s per parse and per comparison), so that those score normally and only a stuck call is killed.

    Raises:
        ValueError: `num_workers < 1`, `timeout <= 0`, or no reward functions.
        TypeError: a reward function is not callable or cannot be serialized with cloudpickle.
        RuntimeError: a worker could not start or could not load a reward function.

    Example::

        from lightning_grpo.rewards import accuracy, boxed_format

        with RewardProcessPool([accuracy, boxed_format], num_workers=2, timeout=30) as pool:
            future = pool.submit(0, completions=["1 + 1 = \\boxed{2}"], answer=["2"])
            print(future.result())  # [1.0]
    """

    def __init__(
        self, reward_funcs: Sequence[Callable[..., Any]] | Callable[..., Any], num_workers: int, timeout: float = 60.0
    ) -> None:
        funcs = [reward_funcs] if callable(reward_funcs) else list(reward_funcs)
        _check_args(funcs, num_workers, timeout)
        self.reward_func_names = [_func_name(f) for f in funcs]
        self._async = [_is_async(f) for f in funcs]
        self.num_workers = num_workers
        self.timeout = float(timeout)
        self._state = _PoolState(self.reward_func_names, _serialize_funcs(funcs, self.reward_func_names), self.timeout)
        self._finalizer = weakref.finalize(self, _shutdown, self._state)
        self._state.start_slots(num_workers)
        problems = self._state.wait_started()
        if problems:
            self.close()
            raise RuntimeError("RewardProcessPool could not start its workers:\n" + "\n".join(problems))

    def submit(self, index: int, /, **kwargs: Any) -> Future[list[float]]:
        """Queues one call of reward function `index` and returns a future of its rewards.

        Args:
            index: Position of the function in `reward_funcs`.
            **kwargs: The function's keyword arguments; `completions` is required (the result has its length).
                Serialized with cloudpickle here, so later changes to these objects do not affect the call.

        Returns:
            A future of one float per completion, NaN where the function returned `None` or the call failed.
            It always resolves, also when the pool is closed (then with NaN).

        Raises:
            ValueError: `index` is out of range, or `completions` is missing.
            TypeError: the function is async, or a keyword argument cannot be serialized with cloudpickle.
            RuntimeError: the pool is closed.
        """
        self._check_index(index)
        if "completions" not in kwargs:
            raise ValueError(
                f"RewardProcessPool.submit({index}, ...) needs `completions=`: the rewards have one entry per "
                f"completion. Got keyword arguments {sorted(kwargs)}."
            )
        size = len(kwargs["completions"])
        try:
            payload = cloudpickle.dumps(kwargs)
        except Exception as err:
            raise TypeError(
                f"RewardProcessPool.submit({index}, ...) cannot send the arguments of reward function "
                f"{self.reward_func_names[index]!r} to a worker: cloudpickle failed with {err!r}. Pass plain data "
                "(strings, numbers, lists, dicts, numpy arrays)."
            ) from err
        return self._state.enqueue(_Call(index, size, payload))

    async def score(self, index: int, /, **kwargs: Any) -> list[float]:
        """Awaitable `submit`: the running event loop keeps running while a worker computes the rewards."""
        return await asyncio.wrap_future(self.submit(index, **kwargs))

    def stats(self) -> dict[str, float]:
        """Counters since start, for metrics.

        Returns:
            `reward_pool/calls_total` (finished calls, any outcome), `reward_pool/errors_total` (calls scored NaN
            because the function raised, returned a bad value or killed its worker twice),
            `reward_pool/timeouts_total`, `reward_pool/restarts_total` (workers that died or were killed at a
            timeout, each replaced) and
            `reward_pool/busy_s` (seconds workers spent on calls, summed over workers).
        """
        return self._state.stats.as_dict()

    def close(self) -> None:
        """Kills every worker and resolves unfinished calls with NaN rewards (not counted as errors).

        Idempotent, never waits for a running call. Also runs when the pool is garbage collected or the
        interpreter exits.
        """
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> RewardProcessPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_index(self, index: int) -> None:
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(self.reward_func_names):
            raise ValueError(
                f"RewardProcessPool.submit(index={index!r}) is not a reward function: expected an int in "
                f"[0, {len(self.reward_func_names)}) indexing {self.reward_func_names}."
            )
        if self._async[index]:
            raise TypeError(
                f"RewardProcessPool.submit(index={index}): reward function {self.reward_func_names[index]!r} is "
                "async; await it in the event loop instead. The pool runs synchronous functions."
            )
        if self.closed:
            raise RuntimeError("RewardProcessPool is closed; create a new pool to score more calls.")


def _check_args(funcs: list[Any], num_workers: int, timeout: float) -> None:
    problems = []
    if not funcs:
        problems.append("`RewardProcessPool(reward_funcs=[])` needs at least one reward function.")
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        problems.append(f"`RewardProcessPool(num_workers={num_workers!r})` must be an int >= 1.")
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not math.isfinite(timeout) or timeout <= 0:
        problems.append(f"`RewardProcessPool(timeout={timeout!r})` must be a finite number of seconds > 0.")
    if problems:
        raise ValueError(" ".join(problems))
    for i, func in enumerate(funcs):
        if not callable(func):
            raise TypeError(f"`RewardProcessPool(reward_funcs=...)`: entry {i} is {func!r}, which is not callable.")


def _is_async(func: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(type(func).__call__)


def _serialize_funcs(funcs: list[Callable[..., Any]], names: list[str]) -> list[bytes]:
    blobs = []
    for func, name in zip(funcs, names, strict=True):
        try:
            blobs.append(cloudpickle.dumps(None if _is_async(func) else func))  # async ones stay in the caller
        except Exception as err:
            raise TypeError(
                f"`RewardProcessPool(reward_funcs=...)` cannot send reward function {name!r} to worker processes: "
                f"cloudpickle failed with {err!r}. Keep open files, locks, sockets and models out of what the "
                "function references, e.g. create them inside the function or make it a module-level function."
            ) from err
    return blobs


def _func_name(func: Any) -> str:
    while isinstance(func, partial):
        func = func.func
    return getattr(func, "__name__", None) or type(func).__name__


@dataclass(slots=True)
class _Call:
    """One queued call: which function, how many completions, its cloudpickled kwargs and its future."""

    index: int
    size: int
    payload: bytes
    future: Future = field(default_factory=Future)


@dataclass(slots=True)
class _Outcome:
    """What a worker made of one call: rewards, or why there are none."""

    kind: str  # "ok" | "error" | "timeout" | "died" | "closed"
    rewards: list[float] | None = None
    message: str = ""  # error summary, or the worker's exit status
    site: str = ""  # where an exception was raised, to group identical errors
    details: str = ""  # traceback text
    busy_s: float = 0.0  # wall time the call held a worker, over all attempts


class _Slot:
    """One worker process and the thread that feeds it calls; the thread also respawns the worker.

    The thread that starts a worker stays alive as long as the pool, which matters because PR_SET_PDEATHSIG fires
    when the *thread* that created the worker exits.
    """

    def __init__(self, state: _PoolState, number: int) -> None:
        self.state = state
        self.number = number
        self.started = threading.Event()
        self.start_problem = ""
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._ready = False
        self._closed = False
        self.thread = threading.Thread(target=self._serve, name=f"reward-pool-{number}", daemon=True)

    def _serve(self) -> None:
        try:
            self.start_problem = self._spawn_and_wait()
        except Exception as err:  # e.g. a platform without `pass_fds`
            self.start_problem = f"worker {self.number} could not start: {err!r}"
        finally:
            self.started.set()
        while (call := self.state.next_call()) is not None:
            try:
                outcome = self._run_with_retry(call)
            except Exception as err:  # a bug here must not leave a caller waiting forever
                log.exception("Reward pool worker %d failed to run a call", self.number)
                outcome = _Outcome("error", message=repr(err))
            self.state.finish(call, outcome)
            if not self._ready and not self.state.closing:
                self._respawn()  # now rather than on the next call, which then finds a worker ready

    def _run_with_retry(self, call: _Call) -> _Outcome:
        """Runs a call; a call whose worker died runs once more on a new worker. Logs what went wrong."""
        outcome = self._run(call)
        if outcome.kind == "died":
            retry = self._run(call)
            retry.busy_s += outcome.busy_s
            self._report_death(call, outcome, retry)
            outcome = retry if retry.kind != "died" else _Outcome("error", busy_s=retry.busy_s)
        if outcome.kind == "timeout":
            message = (
                f"ran longer than timeout={self.state.timeout:g} s; its worker was killed and respawned and the "
                "call's rewards are NaN."
            )
            report_failure(self.state.errors, self.state.names[call.index], "timeout", message)
        return outcome

    def _report_death(self, call: _Call, first: _Outcome, retry: _Outcome) -> None:
        name = self.state.names[call.index]
        if retry.kind == "died":
            level, result = logging.ERROR, f" and again on the retry ({retry.message}); the call's rewards are NaN"
        else:
            level, result = logging.WARNING, "; the call was retried on a new worker"
        self.state.errors.report(
            (name, "died", retry.kind),
            level,
            f"Reward function {name!r} killed its worker process ({first.message}){result}.",
        )

    def _run(self, call: _Call) -> _Outcome:
        """One attempt. A worker that died or timed out is reaped here and respawned by the next attempt."""
        if not self._ready and (problem := self._respawn()):
            return _Outcome("closed" if self.state.closing else "died", message=problem)
        started, conn = time.monotonic(), self._conn
        try:
            if conn is None:  # a ready worker has its pipe
                raise EOFError
            conn.send((call.index, call.size, call.payload))
            reply = self._receive(conn, started + self.state.timeout)
        except (OSError, EOFError):
            reply = ("died", None, self._exit_status(), "", "")
        if reply is None:
            reply = ("timeout", None, "", "", "")
        kind = "closed" if self.state.closing else reply[0]
        if kind in ("died", "timeout"):
            self.kill()
            self.state.stats.add(restarts_total=1.0)
        _, rewards, message, site, details = reply  # the worker's (kind, rewards, message, site, traceback)
        return _Outcome(kind, rewards, message, site, details, busy_s=time.monotonic() - started)

    def _respawn(self) -> str:
        """Replaces the worker; returns a problem, or "" when the new one is ready."""
        started = time.monotonic()
        problem = self._spawn_and_wait()
        if self.state.closing:
            return problem or "the pool closed"
        if problem:
            self.state.errors.report(("respawn",), logging.ERROR, f"Reward pool could not respawn a worker: {problem}")
        else:
            log.debug("Reward pool worker %d respawned in %.2f s", self.number, time.monotonic() - started)
        return problem

    def _receive(self, conn: Connection, deadline: float) -> Any:
        """The worker's next message, or None once `deadline` passed or the pool closed; EOFError if it died."""
        while not self.state.closing:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            if conn.poll(min(remaining, _POLL_S)):
                return conn.recv()
            if self._proc is None or self._proc.poll() is not None:
                raise EOFError
        return None

    def _spawn_and_wait(self) -> str:
        """Starts a worker and waits until it loaded the reward functions; returns a problem, or "" when ready."""
        self.kill()
        if self._conn is not None:
            self._conn.close()  # only this slot's thread uses the connection, so only it closes it
            self._conn = None
        parent_conn, child_conn = multiprocessing.Pipe()
        with self._lock:
            if self._closed:
                parent_conn.close()
                child_conn.close()
                return "the pool closed"
            try:
                self._proc = subprocess.Popen(
                    [sys.executable, "-c", _BOOT, str(child_conn.fileno()), str(os.getpid()), *sys.path],
                    stdin=subprocess.DEVNULL,
                    pass_fds=(child_conn.fileno(),),
                )
            except OSError as err:
                parent_conn.close()
                return f"worker {self.number} could not start: {err!r}"
            finally:
                child_conn.close()
            self._conn = parent_conn
        try:
            parent_conn.send(self.state.func_blobs)
            reply = self._receive(parent_conn, time.monotonic() + STARTUP_TIMEOUT_S)
        except (OSError, EOFError):
            return f"worker {self.number} exited while starting ({self._exit_status()}); its stderr is above."
        if reply is None:
            return f"worker {self.number} was not ready after {STARTUP_TIMEOUT_S:g} s, or the pool closed."
        problems = [f"Reward function {self.state.names[i]!r} {text}" for i, text in reply[1]]
        self._ready = not problems
        return "\n".join(problems)

    def _exit_status(self) -> str:
        return exit_status(self._proc, timeout_s=5)

    def kill(self, final: bool = False) -> None:
        """SIGKILLs the worker and reaps it; with `final`, no worker is started again."""
        with self._lock:
            self._closed = self._closed or final
            proc, self._ready = self._proc, False
        if proc is not None and proc.poll() is None:
            proc.kill()
        if proc is not None:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log.error("Reward pool worker pid %d did not exit 10 s after SIGKILL.", proc.pid)

    def release(self) -> None:
        """Closes the connection once the slot's thread has stopped."""
        if self._conn is not None and not self.thread.is_alive():
            self._conn.close()


class _PoolState:
    """Everything the slot threads share, kept apart from the pool object so that it can be garbage collected."""

    def __init__(self, names: list[str], func_blobs: list[bytes], timeout: float) -> None:
        self.names = names
        self.func_blobs = func_blobs
        self.timeout = timeout
        self.stats = RewardStats()
        self.errors = ErrorLog(logger=log)
        self.closing = False
        self.slots: list[_Slot] = []
        self._cond = threading.Condition()
        self._pending: deque[_Call] = deque()

    def start_slots(self, count: int) -> None:
        self.slots = [_Slot(self, number) for number in range(count)]
        for slot in self.slots:
            slot.thread.start()

    def wait_started(self) -> list[str]:
        for slot in self.slots:
            slot.started.wait()
        return [slot.start_problem for slot in self.slots if slot.start_problem]

    def enqueue(self, call: _Call) -> Future[list[float]]:
        if call.size == 0:
            call.future.set_result([])
            return call.future
        with self._cond:
            if self.closing:
                raise RuntimeError("RewardProcessPool is closed; create a new pool to score more calls.")
            self._pending.append(call)
            self._cond.notify()
        return call.future

    def next_call(self) -> _Call | None:
        """The oldest queued call not cancelled by its caller, or None once the pool closes."""
        with self._cond:
            while True:
                while not self._pending and not self.closing:
                    self._cond.wait()
                if self.closing:
                    return None
                call = self._pending.popleft()
                if call.future.set_running_or_notify_cancel():
                    return call

    def finish(self, call: _Call, outcome: _Outcome) -> None:
        """Records the outcome of a call and resolves its future (NaN unless the call succeeded)."""
        if outcome.kind == "error" and outcome.site:
            report_failure(self.errors, self.names[call.index], "error", outcome.message, outcome.site, outcome.details)
        if outcome.kind != "closed":
            self.stats.add(
                calls_total=1.0,
                errors_total=float(outcome.kind == "error"),
                timeouts_total=float(outcome.kind == "timeout"),
                busy_s=outcome.busy_s,
            )
        rewards = outcome.rewards if outcome.kind == "ok" else [_NAN] * call.size
        with contextlib.suppress(InvalidStateError):  # close() resolved it already
            call.future.set_result(rewards)

    def drain(self) -> list[_Call]:
        with self._cond:
            self.closing = True
            pending = list(self._pending)
            self._pending.clear()
            self._cond.notify_all()
        return pending


def _shutdown(state: _PoolState) -> None:
    """Closes a pool: resolves queued calls with NaN, kills the workers, joins the threads (bounded)."""
    for call in state.drain():
        if call.future.set_running_or_notify_cancel():
            call.future.set_result([_NAN] * call.size)
    for slot in state.slots:
        slot.kill(final=True)
    current = threading.current_thread()
    for slot in state.slots:
        if slot.thread is not current and slot.thread.is_alive():
            slot.thread.join(timeout=10)
    for slot in state.slots:
        slot.kill(final=True)
        slot.release()
    state.errors.flush()
