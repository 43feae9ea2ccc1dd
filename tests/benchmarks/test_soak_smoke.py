"""benchmarks/soak.py end to end on a few steps: every series sampled and judged, and every injected fault counted;
and its trainer-RSS verdict on synthetic series, both ways.

The end-to-end run runs as a user runs it (`python benchmarks/soak.py`, in its own process session: a process left
behind fails). Checked: the structure of the report and the fault counters against the faults the run was given
(exact: each raise is one error, each hang one timeout). Flatness is not asserted: a run this short is all warm-up.
"""

from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path
from types import ModuleType

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
    assert 3 <= result["steps"] <= 4  # one epoch of 8 prompts, two groups a step; the noise reward drops none
    assert [v["series"] for v in result["verdicts"]] == SERIES
    assert any(not math.isnan(row["rollout_rss_mb"]) and row["processes"] >= 2 for row in result["samples"])
    faults = result["faults"]
    assert faults["reward_pool/errors_total"] == {"expected": 2, "counted": 2.0}  # prompts 0 and 4
    assert faults["reward_pool/timeouts_total"] == {"expected": 1, "counted": 1.0}  # prompt 1
    assert result["every_fault_counted"] and result["restarts"] >= 1
    assert "every fault counted" in output and "| series | level | growth over 2nd half |" in output
    assert [quarters["series"] for quarters in result["rss_quarters"]] == ["trainer_rss_mb", "rollout_rss_mb"]
    assert "trainer RSS by quarter: " in output and "rollout RSS by quarter: " in output
    assert all(not math.isnan(row["trainer_heap_in_use_mb"]) for row in result["samples"])  # glibc here


@pytest.fixture
def soak(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """benchmarks/soak.py as a module (it imports its neighbour `common`)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module("soak")


def rss_rows(mb_at_step, steps: int = 1800, every: int = 2, name: str = "trainer_rss_mb") -> list[dict[str, float]]:
    return [{"step": float(step), name: mb_at_step(step)} for step in range(0, steps + 1, every)]


def test_rss_growing_35_kb_a_step_fails_the_soak_with_the_medians_in_the_message(soak):
    quarters = soak.rss_quarters(rss_rows(lambda step: 640.0 + 0.035 * step), "trainer_rss_mb")
    assert quarters["flat"] is False and quarters["growth"] == pytest.approx(0.035 * 900, rel=0.01)
    assert quarters["allowed"] == pytest.approx(16 + 0.02 * quarters["second_quarter"])
    assert quarters["kb_per_step"] == pytest.approx(0.035 * 1024, rel=0.02)
    message = soak.rss_failure([quarters])
    assert message.startswith("soak.py failed: trainer RSS by quarter: GROWS, median 663.6 MB over the 2nd quarter")
    assert "allowed 16 MB + 2% = 29.3 MB" in message


def test_rss_flat_after_warm_up_with_spikes_and_a_step_within_the_allowance_passes(soak):
    def mb(step: int) -> float:  # warm-up, a passing spike, and one heap step of 12 MB
        return 500 + min(step, 100) + (300 if step % 250 == 0 else 0) + (12 if step > 1000 else 0)

    quarters = soak.rss_quarters(rss_rows(mb), "trainer_rss_mb")
    assert quarters["flat"] is True and quarters["growth"] == pytest.approx(12.0)
    assert soak.rss_failure([quarters]) is None and "flat, median 600.0 MB" in soak.rss_message(quarters)


def test_rss_verdict_needs_samples_in_both_quarters_and_skips_missing_values(soak):
    few = soak.rss_quarters(rss_rows(lambda step: 500.0 + step, steps=8, every=4), "trainer_rss_mb")
    assert few["flat"] is None and soak.rss_failure([few]) is None and "not judged" in soak.rss_message(few)
    gaps = soak.rss_quarters(rss_rows(lambda step: math.nan if step % 3 else 700.0 + 0.05 * step), "trainer_rss_mb")
    assert gaps["flat"] is False and gaps["samples"][0] > 3


def test_a_growing_rollout_process_fails_the_soak_naming_it_even_with_a_flat_trainer(soak):
    rows = rss_rows(lambda step: 600.0)
    for row, grown in zip(rows, rss_rows(lambda step: 550.0 + 0.05 * step, name="rollout_rss_mb"), strict=True):
        row.update(grown)
    verdicts = [soak.rss_quarters(rows, name) for name in soak.JUDGED_RSS]
    assert [quarters["flat"] for quarters in verdicts] == [True, False]
    message = soak.rss_failure(verdicts)
    assert message.startswith("soak.py failed: rollout RSS by quarter: GROWS") and "trainer RSS" not in message
