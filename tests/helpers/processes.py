"""Process helpers for tests: descendants of this process, and commands run in their own process session."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest


def is_resource_tracker(process: psutil.Process) -> bool:
    """Python's multiprocessing resource tracker: started once, on first use of shared memory or a spawn context,
    and kept for the interpreter's lifetime; not a leak."""
    return "multiprocessing.resource_tracker" in " ".join(process.cmdline())


def is_forkserver(process: psutil.Process) -> bool:
    """multiprocessing's forkserver, which forks the rollout children: started at the first fit and kept for the
    interpreter's lifetime (`lightning_grpo/rollout/start_method.py`); not a leak, unlike a child it forked."""
    return "from multiprocessing.forkserver import main" in " ".join(process.cmdline())


def live_children() -> list[psutil.Process]:
    """This process's live descendants, except zombies, the resource tracker and the forkserver."""
    children = []
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if child.status() != psutil.STATUS_ZOMBIE and not (is_resource_tracker(child) or is_forkserver(child)):
                children.append(child)
    return children


def wait_no_children(timeout: float = 10.0, ignore: frozenset[int] | set[int] = frozenset()) -> list[psutil.Process]:
    """Wait until no descendant (other than those in `ignore`) is alive; return the ones left after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in live_children() if p.pid not in ignore]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def describe(process: psutil.Process) -> str:
    try:
        return f"{process.pid} ({process.status()}): {' '.join(process.cmdline())[:200]}"
    except psutil.Error:
        return str(process.pid)


def is_exiting(process: psutil.Process) -> bool:
    """A process whose exit is under way: the kernel has released its memory (so its command line reads empty) but
    not yet its last resources, which on a loaded machine (a core dump, a large address space) can take seconds."""
    with contextlib.suppress(psutil.Error):
        return not process.cmdline()
    return True


def session_processes(sid: int) -> list[psutil.Process]:
    """Live processes of the process session `sid` (zombies and the resource tracker excluded)."""
    alive = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError, PermissionError):
            if (
                os.getsid(process.pid) == sid
                and process.status() != psutil.STATUS_ZOMBIE
                and not is_resource_tracker(process)
            ):
                alive.append(process)
    return alive


def run_in_session(args: list[str], *, log: Path, timeout: float, cwd: Path | None = None) -> tuple[int, str]:
    """Run `args` in its own process session with output to `log`; return the exit code and the output.

    Fails the test on a hang (after `timeout` s) or when a process of the session (a rollout child, a reward worker,
    a DDP rank) outlives the command by more than 15 s (45 s for one already exiting); the whole session is SIGKILLed
    in the end either way.
    """
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    with log.open("w") as log_file:
        process = subprocess.Popen(
            args, cwd=cwd, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
    try:
        code = process.wait(timeout=timeout)
        deadline = time.monotonic() + 15
        while session_processes(process.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        deadline = time.monotonic() + 30  # only for processes already exiting: a live one fails the test now
        while (left := session_processes(process.pid)) and all(map(is_exiting, left)) and time.monotonic() < deadline:
            time.sleep(0.1)
        leftovers = [describe(p) for p in session_processes(process.pid)]
    except subprocess.TimeoutExpired:
        pytest.fail(f"`{' '.join(args)}` did not end within {timeout} s (a hang); log:\n{log.read_text()[-4000:]}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    output = log.read_text()
    assert not leftovers, f"processes left behind: {leftovers}\n{output[-3000:]}"
    return code, output


def run_ranks(world_size: int, workdir, timeout: float, target: str = "helpers.tiny:run_score_step_rank") -> None:
    """Run `target(rank, world_size, workdir)` (`module:function` of tests/) in `world_size` fresh processes (own
    sessions, killed as groups on the way out)."""
    module, function = target.split(":")
    code = f"import sys; from {module} import {function} as r; r(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(__file__)), os.environ.get("PYTHONPATH", "")]),
    }
    procs = []
    try:
        for rank in range(world_size):
            log = open(workdir / f"rank{rank}.log", "wb")  # noqa: SIM115 - closed with the process below
            procs.append(
                (
                    subprocess.Popen(
                        [sys.executable, "-c", code, str(rank), str(world_size), str(workdir)],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=env,
                        start_new_session=True,
                    ),
                    log,
                )
            )
        for rank, (proc, _) in enumerate(procs):
            rc = proc.wait(timeout=timeout)
            assert rc == 0, f"rank {rank} failed:\n{(workdir / f'rank{rank}.log').read_text()[-3000:]}"
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()
