"""How the rollout child starts: forked from a server process that has already imported the rollout loop.

A new interpreter takes seconds to import torch, transformers and TRL (about 9 s on a 2-core CPU). A child started
with multiprocessing's "spawn" pays that on every fit; one forked by a "forkserver" that preloaded
`lightning_grpo.rollout.loop` pays it once per Python process, so the second and later fits of a notebook or a test
session start their rollout child in about a second. The server is a fresh interpreter started at the first fit:
it holds none of the trainer's state, has touched no accelerator, runs no thread of its own (the idle helper
threads of numpy's BLAS and pyarrow's allocator aside, which their libraries reset at fork), and exits when this
process does. (Python 3.14 makes it the default start method on Linux.)

The child gets this process's environment as it is when the child starts (`apply_environment`). Variables that the
preloaded modules read when they are imported (`HF_*`, `TRANSFORMERS_*`, `TORCH*`, `OMP_*`, ... see
`IMPORT_TIME_PREFIXES`) cannot follow that way: where one differs from the server's, the child is spawned instead.
`LIGHTNING_GRPO_START_METHOD=spawn` always spawns; other platforms than Linux spawn too.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
from typing import Any

from .interrupts import children_ignore_sigint

log = logging.getLogger(__name__)

#: Set to "spawn" to start every rollout child in a new interpreter.
ENV_SWITCH = "LIGHTNING_GRPO_START_METHOD"
#: What the server imports before it forks children.
PRELOAD = ["lightning_grpo.rollout.loop"]
#: Environment variables read when torch, transformers, TRL and their libraries are imported (or their native
#: libraries load): a child forked from a server started with other values would not see the new ones.
IMPORT_TIME_PREFIXES = (
    "ACCELERATE_", "CUDA", "DATASETS_", "GOMP_", "HF_", "HUGGINGFACE_", "KMP_", "LD_", "MALLOC_", "MKL_",
    "NUMEXPR_", "OMP_", "OPENBLAS_", "PYTHON", "PYTORCH_", "TOKENIZERS_", "TORCH", "TRANSFORMERS_", "TRL_",
)  # fmt: skip

#: The environment variables that size oneDNN's primitive cache and ideep's kernel cache (see `bound_kernel_caches`).
KERNEL_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
KERNEL_CACHE_CAPACITY = 256
_lock = threading.Lock()
# The server this process started (its pid) and the import-time variables it was started with.
_server: dict[str, Any] = {"pid": None, "environment": None}


def rollout_context() -> Any:
    """The multiprocessing context to start the next rollout child with: the preloading forkserver, or "spawn"."""
    if os.environ.get(ENV_SWITCH, "forkserver") == "spawn" or not sys.platform.startswith("linux"):
        return mp.get_context("spawn")
    with _lock:
        reason = _ensure_server()
    if reason is not None:
        log.debug("The rollout child is spawned: %s.", reason)
        return mp.get_context("spawn")
    return mp.get_context("forkserver")


def abandon_server() -> None:
    """Kill the forkserver this module started, for a child asked of it that is no longer wanted (Ctrl-C while it
    preloaded): it would fork that child later, from semaphores the trainer has already released. The next fit
    starts a new server."""
    pid = _server["pid"]
    if pid is not None:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def warm_up() -> None:
    """Start the forkserver now and wait until it has imported the rollout loop, so that the next fit's rollout
    child starts as fast as later ones (before timing fits, say). Does nothing where children are spawned."""
    context = rollout_context()
    if context.get_start_method() == "forkserver":
        process = context.Process(target=os.getpid, name="grpo-forkserver-warm-up")
        process.start()  # answered once the server has imported `PRELOAD`
        process.join()


def release_forkserver() -> None:
    """In a child the forkserver forked: close this process's copy of the write end of the server's "alive" pipe.

    multiprocessing hands that end to every child the server forks, and the server exits only once every copy is
    closed. A child holding one keeps its server alive while the child lives; the server's exit is what sends the
    child its death signal (`lifetime.die_with_parent`) when the trainer dies while the child cannot act (stopped,
    or stuck in native code), so the pair would outlive the trainer. The rollout child starts no process through
    the forkserver, so it needs no copy. Does nothing in a process the forkserver did not fork.
    """
    from multiprocessing import forkserver

    server: Any = getattr(forkserver, "_forkserver", None)
    alive_fd = getattr(server, "_forkserver_alive_fd", None)
    if alive_fd is None or server._forkserver_pid is not None:  # none, or this process's own server
        return
    with contextlib.suppress(OSError):
        os.close(alive_fd)
    server._forkserver_alive_fd = None


def child_environment() -> dict[str, str]:
    """This process's environment, for `apply_environment` in the child."""
    return dict(os.environ)


def apply_environment(environment: dict[str, str]) -> None:
    """Make the child's environment `environment` (a forked child starts with the server's), with the kernel caches
    bounded (`bound_kernel_caches`)."""
    if environment != os.environ:
        os.environ.clear()
        os.environ.update(environment)
    bound_kernel_caches()


def bound_kernel_caches() -> None:
    """Cap oneDNN's and ideep's kernel caches at `KERNEL_CACHE_CAPACITY` entries each, unless the user set them.

    Each keeps one compiled kernel per distinct product shape (1,024 by default, about a megabyte each), read when
    the process builds its first kernel: a generator whose batch and sequence lengths keep varying fills them for
    hours, so its memory keeps growing. Call before the process's first oneDNN product.
    """
    for name in KERNEL_CACHE_VARIABLES:
        os.environ.setdefault(name, str(KERNEL_CACHE_CAPACITY))


def _import_time_environment() -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if key.startswith(IMPORT_TIME_PREFIXES)}


def _ensure_server() -> str | None:
    """Start the server (or a new one if it died) preloading `PRELOAD`; None when it can fork the next child, else
    why not."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    if server is None or not hasattr(server, "_forkserver_pid"):
        return "this Python's forkserver cannot be inspected"
    if server._forkserver_pid is not None and server._forkserver_pid != _server["pid"]:
        return "a forkserver started by other code is running (its environment and preloads are unknown)"
    if _server["pid"] is None:
        mp.get_context("forkserver").set_forkserver_preload(PRELOAD)
    with children_ignore_sigint():  # the server and every child it forks leave Ctrl-C to the trainer
        forkserver.ensure_running()
    if server._forkserver_pid != _server["pid"]:  # started now, or restarted after it died
        _server.update(pid=server._forkserver_pid, environment=_import_time_environment())
    now, then = _import_time_environment(), _server["environment"]
    if now != then:
        changed = ", ".join(sorted(key for key in now.keys() | then.keys() if now.get(key) != then.get(key)))
        return f"{changed} changed since the forkserver started (it read them when it imported torch)"
    return None
