"""Processes that die with their parent: the rollout child and the reward pool's workers."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1
_POLL_S = 0.5


def die_with_parent(parent_pid: int, *, exit_code: int = 1) -> None:
    """Make this process exit when `parent_pid` dies, even by SIGKILL: Linux's `PR_SET_PDEATHSIG`, plus a thread
    that watches the parent id where that is not available. Call it first thing in the child's main thread."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(exit_code)

    def watch() -> None:
        # an orphan is re-parented, so its parent id changes
        while os.getppid() == parent_pid:
            time.sleep(_POLL_S)
        os._exit(exit_code)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
