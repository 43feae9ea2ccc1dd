"""Ctrl-C belongs to the trainer: the processes it starts for rollouts ignore SIGINT from birth.

A terminal sends SIGINT to the whole foreground process group: the trainer, the forkserver, the rollout child and
its reward workers. Only the trainer decides what an interrupt means (it stops the others through
`GRPORolloutWorker.stop()`); a child that took it as a `KeyboardInterrupt` would print its own traceback under the
trainer's message, often in the middle of an import.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def children_ignore_sigint(enabled: bool = True) -> Iterator[None]:
    """Start processes inside this block: each inherits SIGINT ignored (kept across `exec`, so a spawned interpreter
    never installs its KeyboardInterrupt handler). This process ignores it for the block too, so the block must not
    wait (a forkserver's first child waits seconds for its preload: start the server alone in the block)."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def ignore_sigint() -> None:
    """In a rollout child: ignore SIGINT, in case its forkserver was started outside `children_ignore_sigint`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
