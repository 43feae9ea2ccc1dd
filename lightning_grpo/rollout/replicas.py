"""Several embedded generators for one rollout loop: `generator_replicas=N` processes, each on its own cores.

`GRPODataModule(generator_replicas=N)` gives the rollout child `GeneratorReplicasSpec`, which builds
`GeneratorReplicas`: N replica processes (`replica_worker.py`), each a fresh interpreter running one
`EmbeddedGenerator` on `generator_threads` torch threads, pinned to cores of its own when the machine has enough. To
the rollout loop it is one generator (`generate`, `applied_version`, `close`), fed and synced as several vLLM
servers are:

- **Balancing, one replica per group**: a group's first request goes to the replica with the fewest requests in
  flight and all its later requests to the same one (`balancing.GroupRouter`, shared with the vLLM servers), so a
  group's completions are sampled by one replica's sequence of weights; each sample names its replica in
  `extras["generator_replica"]`.
- **Weights**: every replica maps the trainer's one shared-memory block, so a push is published to all replicas at
  once; each copies it in before its next decode step, and tags what it samples with the version it actually holds.
  A sample tagged with version `v` was sampled by the weights of `v`, whichever replica sampled it.
- **A lost replica fails the run**: a replica whose process exits, or that sends no heartbeat for `stale_after_s`
  (half of `GRPODataModule`'s `heartbeat_timeout`), fails every request in flight and every later one with an error
  that names it (index, pid, cores and how it ended), so the rollout child fails and the trainer raises it.

The default `generator_replicas=1` runs the generator on a thread of the rollout child itself, as before; replicas
add one process each and pay for their own import and model load at start. Core borrowing between the trainer and
the generator (`core_sharing.py`) is a single-generator feature: replicas keep their own cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

import cloudpickle

from .balancing import GroupRouter, current_group
from .lifetime import exit_status

if TYPE_CHECKING:
    from .batching import GenerationOutput
    from .generator import GeneratorSpec

log = logging.getLogger(__name__)

# A fresh interpreter with this process's sys.path that imports the replica's module (multiprocessing cannot start
# children of the rollout child, which is a daemon, and spawn would re-run the parent's `__main__`).
# Its command line names the replica (`replica_main <fd> <rollout child's pid> <index>`), as `ps` shows it.
_BOOT = (
    "import sys; sys.path[:] = sys.argv[4:]; "
    "from lightning_grpo.rollout.replica_worker import replica_main; replica_main(sys.argv[1:4])"
)
#: Seconds between two checks of every replica's process and heartbeat.
WATCH_S = 0.5
#: Seconds `close()` gives a replica to stop by itself before it is killed.
CLOSE_GRACE_S = 2.0


class GeneratorReplicasSpec:
    """How to build `GeneratorReplicas` in the rollout child: one generator's `GeneratorSpec`, and how many.

    Args:
        generator: what each replica builds (its `num_threads` is each replica's share of cores; None: the cores the
            process may use, divided among the replicas).
        replicas: the number of replica processes, at least 2.
        stale_after_s: seconds without a heartbeat after which a replica is lost.

    Raises:
        ValueError: fewer than 2 replicas, or a `stale_after_s` that is not positive.
    """

    __slots__ = ("generator", "replicas", "stale_after_s")

    def __init__(self, generator: GeneratorSpec, replicas: int, *, stale_after_s: float = 150.0) -> None:
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 2:
            raise ValueError(
                f"`GeneratorReplicasSpec(replicas={replicas!r})` must be an int >= 2; one generator is the "
                "`GeneratorSpec` itself."
            )
        if not stale_after_s > 0:
            raise ValueError(f"`GeneratorReplicasSpec(stale_after_s={stale_after_s!r})` must be positive.")
        self.generator = generator
        self.replicas = replicas
        self.stale_after_s = float(stale_after_s)

    def build(self, core_sharing: Any = None) -> GeneratorReplicas:
        """Start the replicas and wait until each has built its generator (`core_sharing` is not used: replicas
        keep their own cores)."""
        return GeneratorReplicas(self.generator, self.replicas, stale_after_s=self.stale_after_s)

    def __repr__(self) -> str:
        return f"GeneratorReplicasSpec({self.generator!r}, replicas={self.replicas})"


def replica_cores(replicas: int, threads: int | None, cores: list[int] | None = None) -> tuple[int, list[list[int]]]:
    """Each replica's torch threads and cores: `threads` each (None: an equal share of `cores`, at least 1), replica
    `r` pinned to the `r`-th run of that many cores; no pinning (empty lists) when the cores do not go round."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else cores
    threads = threads or max(1, len(cores) // replicas)
    if threads * replicas > len(cores):
        return threads, [[] for _ in range(replicas)]
    return threads, [cores[r * threads : (r + 1) * threads] for r in range(replicas)]


class GeneratorReplicas:
    """N embedded generators in processes of their own, one generator to the rollout loop (see the module docstring).

    Call `generate` from one event loop. `close()` stops every replica process (idempotent).

    Args:
        spec: what each replica builds.
        replicas: the number of replica processes.
        stale_after_s: seconds without a heartbeat after which a replica is lost.

    Raises:
        RuntimeError: a replica failed to start (its error is in the message); the others are stopped.
    """

    def __init__(self, spec: GeneratorSpec, replicas: int, *, stale_after_s: float = 150.0) -> None:
        threads, cores = replica_cores(replicas, spec.options.get("num_threads"))
        if not cores[0]:
            log.warning(
                "%d generator replicas of %d threads need %d cores; this process may use %d, so they share them.",
                replicas, threads, replicas * threads, len(os.sched_getaffinity(0)),
            )  # fmt: skip
        self.stale_after_s = stale_after_s
        self._router = GroupRouter(replicas)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._failure: str | None = None
        self._closed = False
        payload = cloudpickle.dumps(spec)
        self.replicas = [_Replica(i, replicas, cores[i]) for i in range(replicas)]
        try:
            for replica in self.replicas:
                replica.start(threads, payload)
            for replica in self.replicas:
                replica.wait_ready()
        except BaseException:
            self.close()
            raise
        for replica in self.replicas:
            threading.Thread(
                target=self._read, args=(replica,), name=f"replica-{replica.index}-read", daemon=True
            ).start()
        self._watcher = threading.Thread(target=self._watch, name="replica-watch", daemon=True)
        self._watcher.start()

    @property
    def applied_version(self) -> int:
        """The oldest version any replica holds (each sample carries its own replica's version)."""
        return min(replica.applied_version for replica in self.replicas)

    def replica_of(self, group_id: int) -> int | None:
        """The replica that sampled `group_id`'s completions (None: none of its requests was sent)."""
        return self._router.target_of(group_id)

    def metrics(self) -> dict[str, float]:
        """Every replica's generator counters (as of its last heartbeat), summed."""
        totals: dict[str, float] = {}
        for replica in self.replicas:
            for key, value in replica.metrics.items():
                totals[key] = totals.get(key, 0.0) + value
        return totals

    async def generate(
        self, prompt_ids: list[int], max_tokens: int | None = None, *, seed: int | None = None
    ) -> GenerationOutput:
        """Sample one completion of `prompt_ids` on the current group's replica (`EmbeddedGenerator.generate`).

        Raises:
            ValueError: what the replica's generator refuses (an empty prompt, an id outside the vocabulary).
            RuntimeError: a replica was lost (the message names it), or the replicas are closed.
        """
        if self._failure is not None or self._closed:
            raise RuntimeError(self._failure or "`GeneratorReplicas.generate()` called after `close()`.")
        self._loop = asyncio.get_running_loop()
        index = self._router.route(current_group.get(), range(len(self.replicas)))
        replica, request_id = self.replicas[index], next(self._ids)
        future = self._loop.create_future()
        replica.pending[request_id] = future
        self._router.inflight[index] += 1
        try:
            if not replica.send(("generate", request_id, [int(i) for i in prompt_ids], max_tokens, seed)):
                self._lose(replica, f"could not be reached ({replica.exit_status()})")
            return await future
        finally:
            self._router.inflight[index] -= 1
            replica.pending.pop(request_id, None)

    def close(self) -> None:
        """Stop every replica: ask, then kill what is still running after `CLOSE_GRACE_S`; fail requests in flight."""
        self._closed = True
        for replica in self.replicas:
            replica.send(("close",))
        deadline = time.monotonic() + CLOSE_GRACE_S
        for replica in self.replicas:
            replica.stop(max(0.0, deadline - time.monotonic()))
        self._fail_pending("The generator replicas were closed.")

    def __enter__(self) -> GeneratorReplicas:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- the threads: one reader per replica, one watcher ------------------------------------------------------------

    def _read(self, replica: _Replica) -> None:
        while True:
            try:
                message = replica.conn.recv()
            except (EOFError, OSError):
                if not self._closed:
                    self._lose(replica, f"died ({replica.exit_status()})")
                return
            replica.heard_at = time.monotonic()
            kind = message[0]
            if kind == "beat":
                replica.applied_version, replica.metrics = message[1], message[2]
            elif kind == "done":
                replica.applied_version = message[3]
                self._resolve(replica, message[1], result=message[2])
            elif kind == "error":
                error = ValueError if message[2] == "ValueError" else RuntimeError
                self._resolve(replica, message[1], error=error(f"Generator replica {replica.index}: {message[3]}"))

    def _watch(self) -> None:
        while not self._closed and self._failure is None:
            now = time.monotonic()
            for replica in self.replicas:
                if replica.process is None or replica.process.poll() is not None:
                    self._lose(replica, f"died ({replica.exit_status()})")
                elif now - replica.heard_at > self.stale_after_s:
                    self._lose(
                        replica,
                        f"sent no heartbeat for {now - replica.heard_at:.0f} s (limit {self.stale_after_s:.0f} s: "
                        "half of GRPODataModule's heartbeat_timeout)",
                    )
            time.sleep(WATCH_S)

    def _lose(self, replica: _Replica, why: str) -> None:
        """Fail the run: every request in flight (on any replica) and every later one raise an error naming it."""
        with self._lock:
            if self._failure is not None or self._closed:
                return
            self._failure = f"{replica.name} {why}; the run fails (a lost replica is not replaced)."
        log.error(self._failure)
        self._fail_pending(self._failure)

    def _fail_pending(self, message: str) -> None:
        for replica in self.replicas:
            for request_id in list(replica.pending):
                self._resolve(replica, request_id, error=RuntimeError(message))

    def _resolve(self, replica: _Replica, request_id: int, *, result: Any = None, error: Exception | None = None):
        future, loop = replica.pending.get(request_id), self._loop
        if future is None or loop is None:
            return

        def complete() -> None:
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        with contextlib.suppress(RuntimeError):  # the loop is closed
            loop.call_soon_threadsafe(complete)


class _Replica:
    """One replica process, its connection and what the rollout child knows of it."""

    def __init__(self, index: int, count: int, cores: list[int]) -> None:
        self.index, self.count, self.cores = index, count, cores
        self.process: subprocess.Popen | None = None
        self.conn: Any = None
        self.applied_version = 0
        self.metrics: dict[str, float] = {}
        self.pending: dict[int, asyncio.Future] = {}
        self.heard_at = time.monotonic()
        self._send_lock = threading.Lock()

    @property
    def name(self) -> str:
        cores = f", cores {','.join(map(str, self.cores))}" if self.cores else ""
        pid = self.process.pid if self.process is not None else "not started"
        return f"Generator replica {self.index} of {self.count} (pid {pid}{cores})"

    def start(self, threads: int, payload: bytes) -> None:
        ours, theirs = multiprocessing.Pipe()
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", _BOOT, str(theirs.fileno()), str(os.getpid()), str(self.index), *sys.path],
                stdin=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
            )
        finally:
            theirs.close()
        self.conn = ours
        ours.send((self.cores, threads, payload))

    def wait_ready(self) -> None:
        """Wait until the replica built its generator (the rollout child's own `child_ready_timeout` bounds it)."""
        while not self.conn.poll(0.2):
            if self.process is None or self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited while starting ({self.exit_status()}); its stderr is above.")
        try:
            message = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"{self.name} exited while starting ({self.exit_status()}).") from None
        if message[0] == "failed":
            raise RuntimeError(f"{self.name} could not build its generator: {message[1]}")
        self.applied_version = message[1]
        self.heard_at = time.monotonic()

    def send(self, message: tuple) -> bool:
        """Send `message`; False when the replica cannot be reached."""
        try:
            with self._send_lock:
                self.conn.send(message)
        except (OSError, ValueError, AttributeError):
            return False
        return True

    def exit_status(self) -> str:
        return exit_status(self.process, timeout_s=2.0)

    def stop(self, grace_s: float) -> None:
        process = self.process
        if process is not None and process.poll() is None:
            try:
                process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10.0)
        if self.conn is not None:
            self.conn.close()
