"""Process helpers for tests: descendants of this process, and the one way the suite runs a fit's processes.

A fit (a `lightning-grpo fit`, `tests/scripts/fit_tiny.py`, one node of a multi-node job, one gloo rank) runs as a
command in its own process session (`start_session`), so everything it starts (DDP ranks, the forkserver, the rollout
child, reward workers) can be found and killed as a group. `finish_sessions` waits for the commands, fails the test on
a hang or on a process of a session that outlives its command, and SIGKILLs every session in the end either way.
`run_in_session` is both for one command.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

#: `tests/`, put on the `PYTHONPATH` of every session, so its commands (and their reward workers) import `helpers`.
TESTS = Path(__file__).resolve().parents[1]
#: Seconds a live process of a session may outlive its command; one already exiting gets `EXITING_GRACE_S` more.
LEFTOVER_GRACE_S = 15.0
EXITING_GRACE_S = 30.0


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


@dataclass
class Session:
    """A command running in its own process session (its pid is the session's and the process group's id)."""

    args: list[str]
    log: Path
    process: subprocess.Popen

    @property
    def pid(self) -> int:
        return self.process.pid

    def output(self, tail: int = 3000) -> str:
        return self.log.read_text()[-tail:] if self.log.exists() else ""

    def signal_group(self, signum: int) -> None:
        """Send `signum` to the whole process group, as a terminal sends Ctrl-C or a scheduler a stop."""
        os.killpg(self.pid, signum)


def free_port() -> int:
    """A TCP port free on localhost now (for a job's `MASTER_PORT`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def session_env(env: Mapping[str, str] | None = None, paths: Sequence[Path | str] = ()) -> dict[str, str]:
    """`env` (default: this process's) with the hub offline, unbuffered output, and `paths` plus `tests/` first on
    `PYTHONPATH`."""
    base = dict(os.environ if env is None else env)
    python_path = [*map(str, paths), str(TESTS), *filter(None, [base.get("PYTHONPATH", "")])]
    return base | {"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(python_path)}


def start_session(
    args: Sequence[str],
    *,
    log: Path,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    paths: Sequence[Path | str] = (),
) -> Session:
    """Start `args` in its own process session, stdout and stderr to `log`, with `session_env(env, paths)`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as log_file:
        process = subprocess.Popen(
            list(args),
            cwd=cwd,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=session_env(env, paths),
            preexec_fn=_sigint_as_in_a_terminal,
        )
    return Session(list(args), log, process)


def _sigint_as_in_a_terminal() -> None:
    """Ctrl-C raises KeyboardInterrupt, as in a terminal: a suite started in the background (`cmd &`, nohup, some CI
    runners) has SIGINT ignored, which its children would inherit (and Python keeps an inherited SIG_IGN)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def finish_sessions(sessions: Sequence[Session], *, timeout: float) -> list[int]:
    """Wait for every session's command and return their exit codes.

    Fails the test when a command has not ended within `timeout` s (a hang), or when a process of a session (a
    rollout child, a reward worker, a DDP rank) outlives its command by more than `LEFTOVER_GRACE_S` (plus
    `EXITING_GRACE_S` for one already exiting); every session is SIGKILLed in the end either way.
    """
    deadline = time.monotonic() + timeout
    try:
        codes = [s.process.wait(timeout=max(0.0, deadline - time.monotonic())) for s in sessions]
        leftovers = _leftovers(sessions)
    except subprocess.TimeoutExpired:
        pytest.fail(f"a command did not end within {timeout} s (a hang); logs:\n{tails(sessions)}")
    finally:
        kill_sessions(sessions)
    assert not leftovers, f"processes left behind: {leftovers}\n{tails(sessions)}"
    return codes


def _leftovers(sessions: Sequence[Session]) -> list[str]:
    def left() -> list[psutil.Process]:
        return [p for s in sessions for p in session_processes(s.pid)]

    deadline = time.monotonic() + LEFTOVER_GRACE_S
    while left() and time.monotonic() < deadline:
        time.sleep(0.1)
    deadline = time.monotonic() + EXITING_GRACE_S  # only for processes already exiting: a live one fails now
    while (alive := left()) and all(map(is_exiting, alive)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [describe(p) for p in left()]


def kill_sessions(sessions: Sequence[Session]) -> None:
    """SIGKILL every process of each session (as a scheduler ends a job) and reap the commands."""
    for s in sessions:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(s.pid, signal.SIGCONT)  # a stopped process dies of SIGKILL too, but says so sooner
            os.killpg(s.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            s.process.wait(timeout=30)


def tails(sessions: Sequence[Session], tail: int = 2500) -> str:
    return "\n".join(f"--- {s.log.name}\n{s.output(tail)}" for s in sessions)


def wait_until(condition: Callable[[], bool], sessions: Sequence[Session], *, timeout: float, what: str) -> None:
    """Poll `condition` until it holds; fail if a session's command ended first or `timeout` s passed."""
    deadline = time.monotonic() + timeout
    while not condition():
        for s in sessions:
            if s.process.poll() is not None:
                pytest.fail(f"`{s.log.name}` ended ({s.process.returncode}) before {what}:\n{s.output()}")
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout} s:\n{tails(sessions)}")
        time.sleep(0.05)


def run_in_session(
    args: Sequence[str],
    *,
    log: Path,
    timeout: float,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    paths: Sequence[Path | str] = (),
) -> tuple[int, str]:
    """Run `args` in its own session (`start_session`) and `finish_sessions` it; return its exit code and output."""
    session = start_session(args, log=log, cwd=cwd, env=env, paths=paths)
    (code,) = finish_sessions([session], timeout=timeout)
    return code, log.read_text()


def run_ranks(world_size: int, workdir: Path, timeout: float, target: str = "helpers.tiny:run_score_step_rank") -> None:
    """Run `target(rank, world_size, workdir)` (`module:function` of tests/) in `world_size` fresh processes, each
    in its own session; fails unless every rank exits 0."""
    module, function = target.split(":")
    code = f"import sys; from {module} import {function} as r; r(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])"
    sessions = [
        start_session(
            [sys.executable, "-c", code, str(rank), str(world_size), str(workdir)],
            log=Path(workdir) / f"rank{rank}.log",
        )
        for rank in range(world_size)
    ]
    codes = finish_sessions(sessions, timeout=timeout)
    for rank, rc in enumerate(codes):
        assert rc == 0, f"rank {rank} failed:\n{sessions[rank].output()}"
