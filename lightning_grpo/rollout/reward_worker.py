"""The reward pool's worker process: a fresh interpreter that loads the reward functions and runs one call at a time.

It imports only the standard library, cloudpickle, `lifetime` and `reward_results` (never torch or Lightning), and runs every call on
its main thread, so `signal.alarm` timeouts inside reward functions (math_verify) work.
"""

from __future__ import annotations

import signal
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import cloudpickle

from .lifetime import die_with_parent
from .reward_results import Outcome, run_reward


def worker_main(argv: list[str]) -> None:
    """Entry point of a worker: load the reward functions, then run calls until the parent goes away."""
    fd, parent_pid = int(argv[0]), int(argv[1])
    die_with_parent(parent_pid, exit_code=0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the parent decides
    conn = Connection(fd)
    try:
        funcs, problems = _load_funcs(conn.recv())
    except EOFError:
        return
    conn.send(("ready", problems))
    while True:
        try:
            index, size, payload = conn.recv()
        except EOFError:
            return
        conn.send(_call(funcs[index], size, payload))


def _load_funcs(blobs: list[bytes]) -> tuple[list[Callable[..., Any] | None], list[tuple[int, str]]]:
    funcs, problems = [], []
    for i, blob in enumerate(blobs):
        try:
            funcs.append(cloudpickle.loads(blob))
        except BaseException as err:
            funcs.append(None)
            problems.append(
                (
                    i,
                    f"cannot be loaded in a worker ({err!r}). A function that lives in an importable module is sent "
                    f"by reference, so that module must import in a fresh interpreter.\n{traceback.format_exc()}",
                )
            )
    return funcs, problems


def _call(func: Callable[..., Any], size: int, payload: bytes) -> Outcome:
    return run_reward(lambda: func(**cloudpickle.loads(payload)), size)
