"""benchmarks/scaling.py as a user runs it (a subprocess), on the tiny model with one step: a table row per
configuration and the JSON; and, under a memory limit a random Qwen2.5-1.5B cannot fit in, a "does not fit" row
(the worker's allocation fails under its address-space limit: the machine's memory is never at risk). Never a timing
threshold: the figures of a tiny model on a shared CI machine say nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.processes import live_children

ROOT = Path(__file__).resolve().parents[2]


def run_scaling(out: Path, *args: str) -> tuple[str, dict]:
    env = os.environ | {"LIGHTNING_GRPO_CACHE": str(out / "cache"), "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "benchmarks/scaling.py", "--skip-sweeps", "--warmup", "0", "--steps", "1", *args]
    done = subprocess.run([*command, "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, json.loads((out / "scaling.json").read_text())


@pytest.mark.timeout(300)
def test_each_mode_gets_a_row_with_both_processes_measured(tmp_path):
    printed, report = run_scaling(tmp_path, "--policies", "tiny", "--modes", "full", "LoRA + ckpt", "--length", "8")
    rows = report["rows"]
    assert [(row["policy"], row["mode"]) for row in rows] == [("tiny", "full"), ("tiny", "LoRA + ckpt")]
    for row in rows:
        assert row["fits"] and row["trainer"]["seconds"] > 0 and row["rollout"]["tokens"] == 2 * 8 * 8
        assert row["async_step_s"] == max(row["trainer"]["seconds"], row["rollout"]["seconds"])
        assert 0 < row["trainer"]["peak_gib"] < 4 and 0 < row["rollout"]["peak_gib"] < 4
    assert rows[0]["trainer"]["trainable"] > rows[1]["trainer"]["trainable"]  # LoRA trains the adapters only
    assert printed.count("| tiny |") == 2 and report["largest"] == {"full": "tiny", "LoRA + ckpt": "tiny"}
    assert (tmp_path / "scaling.png").stat().st_size > 0
    assert not live_children()


@pytest.mark.timeout(300)
def test_a_policy_past_the_memory_limit_is_reported_as_not_fitting(tmp_path):
    printed, report = run_scaling(tmp_path, "--policies", "qwen2.5-1.5b", "--modes", "full", "--memory-gib", "3")
    (row,) = report["rows"]
    assert not row["fits"] and not row["trainer"]["fits"] and not row["rollout"]["fits"]
    assert "does not fit" in printed and report["largest"] == {}
