"""Processes that die with their parent (the rollout child, the reward pool's workers, the generator replicas), and
how one ended."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1
_POLL_S = 0.5


def die_with_parent(parent_pid: int, *, exit_code: int = 1) -> None:
    """Make this process exit when `parent_pid` dies, even by SIGKILL: Linux's `PR_SET_PDEATHSIG`, plus a thread
    that watches the parent where that is not available. Call it first thing in the child's main thread.

    `parent_pid` is the process that asked for this one. It is the immediate parent, except for a child forked by a
    multiprocessing forkserver: the server exits when the process that started it dies, provided the child has let
    go of the server's pipe (`start_method.release_forkserver`), so the death signal still comes even to a child that
    cannot run; and the thread watches `parent_pid` itself.
    """
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    immediate = os.getppid()
    if not _alive(parent_pid):  # the parent died before prctl took effect
        os._exit(exit_code)

    def watch() -> None:
        # an orphan is re-parented, so its parent id changes; a forkserver's child watches the process that asked
        while os.getppid() == immediate and _alive(parent_pid):
            time.sleep(_POLL_S)
        os._exit(exit_code)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped, does not)."""
    if pid == os.getppid():
        return True
    if not os.path.isdir("/proc/self"):  # no procfs: signal 0 tells whether it exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return False


def exit_status(process: subprocess.Popen | None, timeout_s: float) -> str:
    """How `process` ended ("killed by SIGKILL", "exit code 1"), waiting up to `timeout_s` for it to end; None is a
    process that was never started."""
    if process is None:
        return "never started"
    try:
        code = process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return "no exit status"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}" if -code in signal.valid_signals() else f"signal {-code}"
    return f"exit code {code}"
