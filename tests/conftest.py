"""Shared fixtures: the tiny random Llama with its in-code character tokenizer, and a process-leak check."""

from __future__ import annotations

import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import psutil  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer():
    from lightning_grpo.models import char_tokenizer

    return char_tokenizer()


@pytest.fixture
def tiny_model():
    """A fresh tiny random Llama (fp32, seed 0) per test, so tests that train it do not leak into others."""
    from lightning_grpo.models import tiny_llama

    return tiny_llama(seed=0)


def live_children() -> list[psutil.Process]:
    """This process's live descendants, except zombies and Python's multiprocessing resource tracker (a helper
    process Python starts once, on first use of shared memory or a spawn context, and keeps for its lifetime)."""
    children = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and "multiprocessing.resource_tracker" not in " ".join(
                child.cmdline()
            ):
                children.append(child)
        except psutil.NoSuchProcess:
            pass
    return children


def wait_no_children(timeout: float = 10.0, ignore: set[int] = frozenset()) -> list[psutil.Process]:
    """Wait until no descendant process (other than those in `ignore`) is alive; return the ones left after
    `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in live_children() if p.pid not in ignore]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


@pytest.fixture
def no_leaked_processes():
    """Fails the test if it leaves a child process alive (checked after the test, with a grace period)."""
    before = {p.pid for p in live_children()}
    yield
    leaked = wait_no_children(ignore=before)
    described = [_describe(p) for p in leaked]
    for p in leaked:
        p.kill()
    assert not leaked, f"processes left behind: {described}"


def _describe(process: psutil.Process) -> str:
    try:
        return f"{process.pid}: {' '.join(process.cmdline())[:200]}"
    except psutil.Error:
        return str(process.pid)
