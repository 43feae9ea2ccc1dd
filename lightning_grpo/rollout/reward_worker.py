"""The reward pool's worker process: a fresh interpreter that loads the reward functions and runs one call at a time.

It imports only the standard library, cloudpickle and `lifetime` (never torch or Lightning), and runs every call on
its main thread, so `signal.alarm` timeouts inside reward functions (math_verify) work.
"""

from __future__ import annotations

import numbers
import signal
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import cloudpickle

from .lifetime import die_with_parent

_NAN = float("nan")


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


def _call(func: Callable[..., Any], size: int, payload: bytes) -> tuple[str, list[float] | None, str, str, str]:
    """Runs one call; returns (kind, rewards, message, site, traceback) for the parent."""
    try:
        result = func(**cloudpickle.loads(payload))
    except BaseException as err:
        frame = traceback.extract_tb(err.__traceback__)[-1]
        return "error", None, f"{type(err).__name__}: {err}", f"{frame.filename}:{frame.lineno}", traceback.format_exc()
    try:
        return "ok", _as_rewards(result, size), "", "", ""
    except Exception as err:
        return "error", None, str(err), "result", ""


def _as_rewards(result: Any, size: int) -> list[float]:
    values = result.tolist() if hasattr(result, "tolist") else result  # numpy arrays and tensors
    if not isinstance(values, list | tuple) or len(values) != size:
        raise TypeError(f"it returned {_short_repr(result)}; expected a list of {size} floats, one per completion.")
    rewards = []
    for value in values:
        if value is None:
            rewards.append(_NAN)
        elif isinstance(value, numbers.Real):
            rewards.append(float(value))
        else:
            raise TypeError(
                f"it returned {_short_repr(result)}, which holds {value!r}; rewards must be floats or None."
            )
    return rewards


def _short_repr(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
