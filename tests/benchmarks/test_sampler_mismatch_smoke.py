"""benchmarks/sampler_mismatch.py end to end on the tiny model: each generator precision's log-probabilities against
the trainer's teacher-forced ones, as a user runs it (a subprocess in its own session: a process left behind fails).

Checked: an fp32 generator against the fp32 trainer differs by nothing but summation order (the exactness the
generator's tests hold it to), a bf16 generator by more, and the JSON it writes; never a timing."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from helpers.processes import run_in_session

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_each_generator_precision_is_held_against_each_trainer_precision(tmp_path):
    command = [sys.executable, "benchmarks/sampler_mismatch.py", "--model", "tiny", "--prompts", "2", "--samples", "2"]
    command += ["--max-tokens", "8", "--configs", "bf16", "fp32", "--out", str(tmp_path / "mismatch.json")]
    code, output = run_in_session(command, log=tmp_path / "log", timeout=280, cwd=ROOT)
    assert code == 0, output[-3000:]
    results = json.loads((tmp_path / "mismatch.json").read_text())["results"]
    assert set(results) == {"bf16 / bf16-mixed", "bf16 / 32-true", "fp32 / bf16-mixed", "fp32 / 32-true"}
    assert results["fp32 / 32-true"]["mean_abs"] < 1e-5
    assert results["bf16 / 32-true"]["mean_abs"] > 10 * results["fp32 / 32-true"]["mean_abs"]
    line = re.search(r"^fp32 +32-true +(\d+) ", output, re.MULTILINE)
    assert line is not None and int(line.group(1)) == results["fp32 / 32-true"]["tokens"] > 0
