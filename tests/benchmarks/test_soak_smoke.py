"""benchmarks/soak.py end to end on a few steps: every series sampled and judged, and every injected fault counted.

It runs as a user runs it (`python benchmarks/soak.py`, in its own process session: a process left behind fails).
Checked: the structure of the report and the fault counters against the faults the run was given (exact: each
raise is one error, each hang one timeout). Flatness is not asserted: a run this short is all warm-up.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from helpers.processes import run_in_session

ROOT = Path(__file__).resolve().parents[2]
QUICK = ["--steps", "4", "--prompts", "8", "--raise-every", "4", "--hang-every", "8", "--interval", "0.5"]
SERIES = ["trainer_rss_mb", "trainer_fds", "trainer_threads", "rollout_rss_mb", "rollout_fds", "rollout_threads"]
SERIES += ["processes", "shm_segments"]


@pytest.mark.timeout(300)
def test_soak_samples_every_series_judges_each_and_counts_every_injected_fault(tmp_path):
    command = [sys.executable, "benchmarks/soak.py", *QUICK, "--out", str(tmp_path)]
    code, output = run_in_session(command, log=tmp_path / "log.txt", timeout=280, cwd=ROOT)
    assert code == 0, output[-3000:]
    result = json.loads((tmp_path / "soak.json").read_text())
    assert 1 <= result["steps"] <= 4  # one epoch of 8 prompts, two groups a step; a group without signal is dropped
    assert [v["series"] for v in result["verdicts"]] == SERIES
    assert any(not math.isnan(row["rollout_rss_mb"]) and row["processes"] >= 2 for row in result["samples"])
    faults = result["faults"]
    assert faults["reward_pool/errors_total"] == {"expected": 2, "counted": 2.0}  # prompts 0 and 4
    assert faults["reward_pool/timeouts_total"] == {"expected": 1, "counted": 1.0}  # prompt 1
    assert result["every_fault_counted"] and result["restarts"] >= 1
    assert "every fault counted" in output and "| series | level | growth over 2nd half |" in output
