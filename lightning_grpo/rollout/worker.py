"""The trainer-side handle of the rollout child process: start, stop, health, shared counters."""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import sys
import threading
import time
import traceback
from typing import Any

import cloudpickle
import psutil

from .interrupts import children_ignore_sigint, ignore_sigint
from .lifetime import die_with_parent
from .start_method import abandon_server, apply_environment, child_environment, release_forkserver, rollout_context

log = logging.getLogger(__name__)

#: Seconds `stop()` waits for the child to leave its loop before it is terminated, then killed.
STOP_GRACE_S = 5.0


class GRPORolloutWorker:
    """Runs `GRPORolloutLoop` (or `loop_cls`) in a CUDA-free child process (forked by a forkserver that preloaded
    the loop, or spawned); TRL's rollout-worker protocol.

    Only rank 0 holds one. The child generates and scores groups and puts `RolloutSample`s on `rollout_buffer`;
    the trainer reads them, bumps `model_version` after each weight sync and reports how many groups it consumed
    (`groups_consumed`), which paces generation (see `GRPORolloutLoop`).

    Unlike TRL's `AsyncRolloutWorker` it needs no vllm installed, ships the loop's keyword arguments with cloudpickle
    (reward functions defined in a notebook cell, lambdas and closures work), names the argument that cannot be
    shipped, dies with its parent, and `stop()` ends the child and every process under it (the reward pool's
    workers included) within seconds, also after a crash.

    Args:
        loop_cls: the loop class the child runs; `GRPORolloutLoop` by default.
        queue_maxsize: capacity of `rollout_buffer` in samples (0 = unbounded).
        child_ready_timeout: seconds `start()` waits for the child to build its loop (load the model, spawn the
            reward pool).
        mp_context: multiprocessing context; "spawn" or "forkserver" on anything that imported torch (never
            "fork"). By default a forkserver that has imported the rollout loop, where it can be used
            (`rollout/start_method.py`: later children start in about a second), else "spawn".
        **loop_kwargs: forwarded to `loop_cls` in the child. Values that are multiprocessing primitives (queues,
            values, locks, or objects holding them, like a weight receiver) travel as process arguments; everything
            else travels with cloudpickle. `generator` may be a `GeneratorSpec`, a `GeneratorReplicasSpec` (several
            generator processes), `"embedded"` (the policy `model_name` names, loaded in the child, sampling with
            the loop's `temperature`, `top_p`, `top_k`, `max_tokens` and `eos_token_ids`; it never receives new
            weights), or None / `"vllm"` (TRL's HTTP path to `vllm_server_url`).

    Raises:
        TypeError: a `generator` that is none of those.
    """

    def __init__(
        self,
        loop_cls: type | None = None,
        *,
        queue_maxsize: int = 0,
        child_ready_timeout: float = 300.0,
        mp_context: Any = None,
        **loop_kwargs: Any,
    ) -> None:
        if loop_cls is None:
            from .loop import GRPORolloutLoop

            loop_cls = GRPORolloutLoop
        ctx = mp_context or rollout_context()
        self._ctx = ctx
        self._loop_cls = loop_cls
        self._loop_kwargs = dict(loop_kwargs, queue_maxsize=queue_maxsize)
        self._loop_kwargs["generator"] = _generator_spec(self._loop_kwargs)
        self._child_ready_timeout = child_ready_timeout
        self.rollout_buffer = ctx.Queue(maxsize=queue_maxsize)
        self.metrics_queue = ctx.Queue(maxsize=4096)
        self._model_version_value = ctx.Value("i", 0)
        self._groups_consumed_value = ctx.Value("q", 0)
        self._heartbeat_value = ctx.Value("d", 0.0)
        self._stop_event = ctx.Event()
        self._ready_event = ctx.Event()
        self._failed_event = ctx.Event()
        self._exception_queue = ctx.Queue(maxsize=1)
        self._process: Any = None
        self._failure: str | None = None
        self._hung = False  # check_health found the heartbeat stale: stop() kills at once

    # -- shared counters -------------------------------------------------------------------------------------------

    @property
    def model_version(self) -> int:
        return int(self._model_version_value.value)

    @model_version.setter
    def model_version(self, value: int) -> None:
        with self._model_version_value.get_lock():
            self._model_version_value.value = int(value)

    def update_model_version(self, model_version: int) -> None:
        """Tell the child which policy version is live (TRL protocol)."""
        self.model_version = model_version

    @property
    def groups_consumed(self) -> int:
        """Groups the trainer consumed (trained or dropped) in this run; the loop paces admission on it."""
        return int(self._groups_consumed_value.value)

    @groups_consumed.setter
    def groups_consumed(self, value: int) -> None:
        with self._groups_consumed_value.get_lock():
            self._groups_consumed_value.value = int(value)

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    # -- lifecycle ---------------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Spawn the child and wait until its loop is built.

        Raises:
            TypeError: a loop argument cannot be shipped to the child (named in the message).
            RuntimeError: the child failed while building its loop (with its traceback) or was not ready in time.
        """
        if self._process is not None:
            raise RuntimeError("GRPORolloutWorker.start() was called twice; create a new worker for a new run.")
        payload, inherited = _split_shippable(self._loop_kwargs)
        self._heartbeat_value.value = time.time()  # spawn-import latency must not trip check_health
        self._process = self._ctx.Process(
            target=_child_entry,
            args=(
                cloudpickle.dumps(self._loop_cls),
                payload,
                inherited,
                child_environment(),
                os.getpid(),
                self.rollout_buffer,
                self._model_version_value,
                self._groups_consumed_value,
                self._stop_event,
                self._ready_event,
                self._heartbeat_value,
                self._failed_event,
                self._exception_queue,
                self.metrics_queue,
            ),
            name="grpo-rollout-child",
            daemon=True,
        )
        # Ctrl-C is the trainer's (rollout/interrupts.py); a forkserver's children inherit its ignored SIGINT
        try:
            with children_ignore_sigint(enabled=self._ctx.get_start_method() == "spawn"):
                self._process.start()
        except BaseException:
            if self._process._popen is None and self._ctx.get_start_method() == "forkserver":
                abandon_server()  # interrupted while the server preloaded: it must not fork this child later
            raise
        log.info("rollout child started (pid %s, %s)", self._process.pid, self._ctx.get_start_method())
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self._child_ready_timeout
        while not self._ready_event.wait(timeout=0.2):
            if not self._process.is_alive():
                detail = self._child_error() or f"exit code {self._process.exitcode}"
                self.stop()
                raise RuntimeError(f"The rollout child failed while building its loop: {detail}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"The rollout child was not ready within child_ready_timeout={self._child_ready_timeout} s. "
                    "Loading a large policy or spawning the reward pool may need more: raise child_ready_timeout."
                )

    def check_health(self, stale_after_s: float) -> None:
        """Raise `RuntimeError` if the child failed, died, or has not ticked its heartbeat for `stale_after_s` s.

        The message carries the child's traceback when it failed with an exception.
        """
        if self._process is None:
            raise RuntimeError("The rollout child is not running: call start() first.")
        if self._failed_event.is_set() or not self._process.is_alive():
            detail = self._child_error()
            if detail is None:
                code = self._process.exitcode
                how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                detail = f"the process died ({how}) without reporting an exception"
            raise RuntimeError(f"The rollout child (pid {self._process.pid}) failed: {detail}")
        age = time.time() - self._heartbeat_value.value
        if age > stale_after_s:
            self._hung = True
            raise RuntimeError(
                f"The rollout child (pid {self._process.pid}) is hung: no heartbeat for {age:.0f} s "
                f"(limit {stale_after_s:.0f} s)."
            )

    def _child_error(self) -> str | None:
        if self._failure is None:
            with contextlib.suppress(queue.Empty, OSError, ValueError):
                type_name, message, tb = self._exception_queue.get(timeout=0.5)
                self._failure = f"{type_name}: {message}\n--- child traceback ---\n{tb}"
        return self._failure

    def stop(self) -> None:
        """End the child and every process under it; idempotent, and safe after a crash.

        A child found hung (`check_health`) is killed at once, without the grace a working child gets to stop: it
        would only keep the trainer's own exit waiting, which a launcher may cut short (Lightning's kills every rank
        once one exits with an error), leaving the child behind.
        """
        process, self._process = self._process, None
        if process is None or process._popen is None:
            return
        descendants = _descendants(process.pid)
        if process.is_alive():
            # A stopped (SIGSTOP) process acts on nothing, not even SIGTERM, until continued; nor does its
            # parent-watch thread, and it keeps the forkserver that forked it alive, which keeps it alive in turn.
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGCONT)
            _set_without_blocking(self._stop_event)
        process.join(timeout=0 if self._hung else STOP_GRACE_S)
        if process.is_alive():
            if not self._hung:
                log.warning("rollout child did not stop within %.0f s; terminating it", STOP_GRACE_S)
            process.terminate()
            process.join(timeout=2.0)
        if process.is_alive():
            process.kill()
            process.join(timeout=2.0)
        _kill_all(descendants + _descendants(process.pid))
        # Keep the handle so check_health still reports a stopped child, not "call start() first".
        self._process = _Stopped(process.pid, process.exitcode)


def _generator_spec(loop_kwargs: dict[str, Any]) -> Any:
    """The loop's `generator` argument as a `GeneratorSpec`, or None for TRL's vLLM HTTP path."""
    from .generator import GeneratorSpec
    from .replicas import GeneratorReplicasSpec

    generator = loop_kwargs.get("generator")
    if generator is None or generator == "vllm" or isinstance(generator, GeneratorSpec | GeneratorReplicasSpec):
        return None if generator == "vllm" else generator
    if generator == "embedded":
        options = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_tokens": 256} | {
            key: loop_kwargs[key] for key in ("temperature", "top_p", "top_k", "max_tokens") if key in loop_kwargs
        }
        eos = loop_kwargs.get("eos_token_ids")
        if not loop_kwargs.get("model_name"):
            raise TypeError(
                "`GRPORolloutWorker(generator='embedded')` loads the policy `model_name` names in the child: pass "
                "`model_name=` ('tiny-random', 'smollm2-135m-instruct', a local folder or a Hub id)."
            )
        return GeneratorSpec(
            loop_kwargs["model_name"],
            eos_token_ids=tuple(eos) if eos else None,
            max_batch_size=max(64, int(loop_kwargs.get("num_generations", 8))),
            **options,
        )
    raise TypeError(
        f"`GRPORolloutWorker(generator={generator!r})` is not a generator: pass a `GeneratorSpec`, 'embedded' (the "
        "policy `model_name` names, on CPU in the child) or None / 'vllm' (a vLLM server at `vllm_server_url`)."
    )


class _Stopped:
    """What is left of a stopped child: enough for `pid`, `check_health` and a second `stop()`."""

    _popen = None

    def __init__(self, pid: int, exitcode: int | None) -> None:
        self.pid = pid
        self.exitcode = exitcode

    def is_alive(self) -> bool:
        return False


def _split_shippable(kwargs: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
    """cloudpickle what can be pickled; keep multiprocessing primitives aside to pass as process arguments."""
    shippable, inherited = {}, {}
    for name, value in kwargs.items():
        try:
            cloudpickle.dumps(value)
        except RuntimeError as error:
            if "inheritance" not in str(error):
                raise TypeError(f"GRPORolloutWorker cannot ship `{name}` to the rollout child: {error}") from error
            inherited[name] = value  # mp primitives may only cross at spawn time, as process arguments
        except Exception as error:
            raise TypeError(
                f"GRPORolloutWorker cannot ship `{name}={value!r:.80}` to the rollout child: "
                f"{type(error).__name__}: {error}. Pass something cloudpickle can serialize (functions, classes and "
                "their instances, data), not open handles such as files, sockets, locks or threads."
            ) from error
        else:
            shippable[name] = value
    return cloudpickle.dumps(shippable), inherited


def _set_without_blocking(event: Any, timeout: float = 1.0) -> None:
    """Set an mp.Event without hanging when a process that waited on it was killed.

    `Event.set()` waits for every sleeper to wake; a sleeper killed mid-wait never does, so set it from a helper
    thread and give up after `timeout` (the child is then terminated anyway).
    """
    setter = threading.Thread(target=event.set, name="grpo-stop-signal", daemon=True)
    setter.start()
    setter.join(timeout)


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _kill_all(processes: list[psutil.Process]) -> None:
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(processes, timeout=3.0)


def _child_entry(
    loop_cls_payload: bytes,
    kwargs_payload: bytes,
    inherited: dict[str, Any],
    environment: dict[str, str],
    parent_pid: int,
    rollout_buffer: Any,
    model_version_value: Any,
    groups_consumed_value: Any,
    stop_event: Any,
    ready_event: Any,
    heartbeat_value: Any,
    failed_event: Any,
    exception_queue: Any,
    metrics_queue: Any,
) -> None:
    ignore_sigint()
    die_with_parent(parent_pid)
    release_forkserver()
    apply_environment(environment)
    try:
        from .._trl import _child_main

        loop_cls = cloudpickle.loads(loop_cls_payload)
        loop_kwargs = cloudpickle.loads(kwargs_payload) | inherited
        if getattr(loop_cls, "_accepts_groups_consumed", False):
            loop_kwargs["groups_consumed_value"] = groups_consumed_value
    except BaseException as error:
        _report(error, exception_queue, failed_event)
        raise
    try:
        # TRL's child main: scrubs CUDA and distributed env vars, builds the loop, signals ready, runs it.
        _child_main(
            loop_cls,
            loop_kwargs,
            rollout_buffer,
            model_version_value,
            stop_event,
            ready_event,
            heartbeat_value,
            failed_event,
            exception_queue,
            metrics_queue,
        )
    except BaseException as error:
        if not failed_event.is_set():  # failed while building the loop, before TRL's run() could report it
            _report(error, exception_queue, failed_event)
        raise
    _exit_after_stop(rollout_buffer, metrics_queue)


def _exit_after_stop(*queues: Any) -> None:
    """End the child as soon as its loop stopped cleanly (`stop()` asked for it, and its pools are closed).

    A normal interpreter exit with torch and transformers loaded spends seconds freeing modules (more on a busy
    machine), which `stop()` would wait for and then terminate. What is still buffered for the queues is dropped
    instead of flushed: the trainer stopped reading them before it called `stop()`.
    """
    for q in queues:
        q.cancel_join_thread()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


def _report(error: BaseException, exception_queue: Any, failed_event: Any) -> None:
    with contextlib.suppress(Exception):
        exception_queue.put_nowait((type(error).__name__, str(error), traceback.format_exc()))
    failed_event.set()
