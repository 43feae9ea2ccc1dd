"""One generator replica's process: a fresh interpreter on its own cores that runs one `EmbeddedGenerator`.

`GeneratorReplicas` (in the rollout child) starts it and talks to it over one connection. The replica answers each
request with its `GenerationOutput` and the version of the weights it holds, and sends a heartbeat every
`HEARTBEAT_S` seconds. Weights come straight from the trainer's shared-memory block, which every replica maps.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import traceback
from multiprocessing.connection import Connection
from typing import Any

import cloudpickle

from .lifetime import die_with_parent

#: Seconds between two heartbeats of a replica (its version and counters).
HEARTBEAT_S = 1.0


def replica_main(argv: list[str]) -> None:
    """Entry point: `argv` is the connection's file descriptor, the rollout child's pid and the replica's index."""
    fd, parent_pid, index = (int(arg) for arg in argv)
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the trainer decides
    conn = Connection(fd)
    try:
        cores, threads, payload = conn.recv()
    except EOFError:
        return
    if cores:
        os.sched_setaffinity(0, cores)  # before torch starts its thread pool, whose threads inherit it
    _attach_without_tracking()
    send = _Sender(conn)
    try:
        generator = _build(cloudpickle.loads(payload), index, threads)
    except BaseException as error:  # noqa: BLE001 -- reported to the rollout child as text
        send(("failed", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
        return
    send(("ready", generator.applied_version))
    asyncio.run(_serve(conn, send, generator))


def _attach_without_tracking() -> None:
    """Keep the trainer's shared-memory block out of a resource tracker of this process.

    Before Python 3.13 attaching to a block registers it with the attaching process's tracker, which unlinks it when
    that process exits: a replica that ends (or is killed) would delete the trainer's weights. This process only
    attaches, never creates, so it registers nothing.
    """
    from multiprocessing import resource_tracker

    register = resource_tracker.register

    def register_but_shared_memory(name: str, rtype: str) -> None:
        if rtype != "shared_memory":
            register(name, rtype)

    resource_tracker.register = register_but_shared_memory  # type: ignore[assignment]  # typeshed: `name: Sized`


def _build(spec: Any, index: int, threads: int) -> Any:
    """The replica's generator: the spec's arguments on `threads` torch threads; a seeded spec seeds each replica
    apart, so two replicas never draw the same samples."""
    from .generator import EmbeddedGenerator

    options = dict(spec.options, num_threads=threads)
    if options.get("seed") is not None:
        options["seed"] = int(options["seed"]) + index
    return EmbeddedGenerator(spec.policy, **options)


class _Sender:
    """`conn.send` from the event loop and the heartbeat thread; a vanished rollout child is not an error here (this
    process dies with it)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()

    def __call__(self, message: tuple) -> None:
        with self._lock, contextlib.suppress(OSError, ValueError):
            self._conn.send(message)


async def _serve(conn: Connection, send: _Sender, generator: Any) -> None:
    """Answer requests until the rollout child says "close" or goes away; then stop the generator."""
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    tasks: set[asyncio.Task] = set()

    def on_message(message: tuple | None) -> None:
        if message is None or message[0] == "close":
            done.set()
            return
        task = loop.create_task(_answer(send, generator, *message[1:]))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def read() -> None:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                message = None
            loop.call_soon_threadsafe(on_message, message)
            if message is None or message[0] == "close":
                return

    def beat() -> None:
        while not done.is_set():
            send(("beat", generator.applied_version, generator.metrics()))
            threading.Event().wait(HEARTBEAT_S)

    threading.Thread(target=read, name="replica-read", daemon=True).start()
    threading.Thread(target=beat, name="replica-heartbeat", daemon=True).start()
    try:
        await done.wait()
    finally:
        generator.close()
        for task in tasks:
            task.cancel()


async def _answer(send: _Sender, generator: Any, request_id: int, prompt_ids: list[int], max_tokens: Any, seed: Any):
    try:
        output = await generator.generate(prompt_ids, max_tokens, seed=seed)
    except Exception as error:  # noqa: BLE001 -- sent back as text, raised in the rollout loop
        send(("error", request_id, type(error).__name__, str(error)))
        return
    send(("done", request_id, output, generator.applied_version))
