"""Shared fixtures: the tiny random Llama with its in-code character tokenizer, and a process-leak check."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
from processes import describe, live_children, wait_no_children  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer():
    from lightning_grpo.models import char_tokenizer

    return char_tokenizer()


@pytest.fixture
def tiny_model():
    """A fresh tiny random Llama (fp32, seed 0) per test, so tests that train it do not leak into others."""
    from lightning_grpo.models import tiny_llama

    return tiny_llama(seed=0)


@pytest.fixture
def no_leaked_processes():
    """Fails the test if it leaves a child process alive (checked after the test, with a grace period)."""
    before = {p.pid for p in live_children()}
    yield
    leaked = wait_no_children(ignore=before)
    described = [describe(p) for p in leaked]
    for p in leaked:
        p.kill()
    assert not leaked, f"processes left behind: {described}"
