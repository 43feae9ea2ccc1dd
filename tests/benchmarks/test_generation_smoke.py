"""benchmarks/generation.py end to end on the tiny model with minimal work: every backend samples the load's tokens
in the dtype asked, and each one's model FLOP/s is reported against the peaks measured in the same run.

It runs as a user runs it (`python benchmarks/generation.py`, a subprocess in its own session: a process left behind
fails). Checked: the structure of the output and that each fraction is its two figures' ratio; never a timing.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from helpers.processes import run_in_session

ROOT = Path(__file__).resolve().parents[2]
QUICK = ["--models", "tiny-random", "--groups", "2", "--group-size", "2", "--max-tokens", "4", "--reps", "1"]
QUICK += ["--parts", "generation", "--dtype", "bfloat16"]


@pytest.mark.timeout(300)
def test_every_backend_samples_the_load_in_the_dtype_asked_and_is_set_against_this_runs_peaks(tmp_path):
    code, output = run_in_session(
        [sys.executable, "benchmarks/generation.py", *QUICK], log=tmp_path / "log", timeout=280, cwd=ROOT
    )
    assert code == 0, output[-3000:]
    assert "dtype bfloat16 (generator_dtype='bfloat16')" in output
    assert "tiny-random in bfloat16: matmul peaks (GFLOP/s) float32 at 64 rows" in output
    decode_peak = float(re.search(r"decode peak: (\d+) GFLOP/s", output).group(1))
    best_peak = float(re.search(r"best: (\d+), ", output).group(1))
    assert best_peak >= decode_peak > 0
    for backend in ("embedded", "static", "hf-generate"):
        line = re.search(rf"^{backend} +([\d.]+) +([\d.]+)% +([\d.]+)%$", output, re.MULTILINE)
        assert line is not None, output[-2000:]
        gflops, of_decode, of_best = map(float, line.groups())
        assert of_decode == pytest.approx(100 * gflops / decode_peak, abs=0.1 + 0.01 * of_decode)
        assert of_best == pytest.approx(100 * gflops / best_peak, abs=0.1 + 0.01 * of_best)


@pytest.mark.timeout(300)
def test_int8_weights_run_beside_the_embedded_generator_and_are_held_to_their_own_bandwidth_bound(tmp_path):
    """With `--int8` the generator with int8 weights samples the same load; its bound counts the int8 bytes (the
    layers' weights at one byte an element), fewer than the bf16 bound's."""
    code, output = run_in_session(
        [sys.executable, "benchmarks/generation.py", *QUICK, "--int8"], log=tmp_path / "log", timeout=280, cwd=ROOT
    )
    assert code == 0, output[-3000:]
    assert re.search(r"^embedded-int8 +[\d.]+ +[\d.]+% +[\d.]+%$", output, re.MULTILINE), output[-2000:]
    megabytes = [int(m) for m in re.findall(r"each step a read of the (\d+) MB of (?:int8 )?weights", output)]
    assert len(megabytes) == 2 and megabytes[1] < megabytes[0], output[-2000:]
    assert re.search(r"embedded-int8 [\d.]+% of its bound", output)
