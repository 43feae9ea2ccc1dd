"""benchmarks/decode_attention.py end to end at small sizes, as a user runs it (a subprocess in its own session: a
process left behind fails).

Checked: every case gets a row and a JSON entry with positive times, the byte count the cases' positions give, and
the kernel's output within the benchmark's tolerance of float64 attention (which the benchmark itself enforces);
never a timing."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers.processes import run_in_session

from lightning_grpo.rollout import decode_attention

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not decode_attention.available(), reason=f"{decode_attention.unavailable_reason()}")
@pytest.mark.timeout(300)
def test_each_case_is_timed_against_a_contiguous_read_of_its_bytes_after_its_output_is_checked(tmp_path):
    command = [sys.executable, "benchmarks/decode_attention.py", "--rows", "8", "--groups", "4", "8", "--own", "3"]
    command += ["--prefix", "5", "--layers", "2", "--reps", "2", "--capacity", "32", "--out", str(tmp_path / "a.json")]
    code, output = run_in_session(command, log=tmp_path / "log", timeout=280, cwd=ROOT)
    assert code == 0, output[-3000:]
    cases = json.loads((tmp_path / "a.json").read_text())["cases"]
    assert [(case["own"], case["group"]) for case in cases] == [(3, 4), (3, 8)]
    for case in cases:
        positions = 8 // case["group"] * 5 + 8 * (3 + 1)  # each group's prompt once, each row's own and new position
        assert case["bytes"] == 2 * 2 * 3 * 64 * 2 * positions  # layers x (keys, values) x heads x dim x bf16
        assert min(case["kernel_s"], case["tight_slots_s"], case["contiguous_read_s"]) > 0
        assert case["max_abs_error"] < 0.05
    assert output.count("\n    3 ") == 2  # one table row per case
