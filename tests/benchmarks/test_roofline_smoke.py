"""benchmarks/roofline.py end to end on the tiny model with minimal repetitions: the table, the JSON and the plot.

It runs as a user runs it (`python benchmarks/roofline.py`, a subprocess, so its thread settings and its fit stay
out of this process) with a cache folder of its own. Checked: the structure (every stage, one table line per row)
and that every fraction is finite, positive and the ratio of its two figures; never a timing threshold, since the
figures of a tiny model on a shared CI machine say nothing.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
QUICK = [
    "--model", "tiny", "--reps", "1", "--peak-seconds", "0.005", "--decode-tokens", "4", "--batches", "1", "4",
    "--train-groups", "1", "--reward-groups", "4", "--fit-prompts", "4",
]  # fmt: skip
STAGES = [
    "decode, batch 1", "decode, batch 4", "prefill, batch 1", "prefill, batch 4", "train step (fwd+bwd)",
    "reference forward", "weight push", "reward scoring", "async step: waiting for rollouts",
    "async step: training (fwd+bwd)", "async step: pushing weights", "async step: the rest",
    "async step: generation", "async step: scoring",
]  # fmt: skip


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("roofline")
    # the machine's own precision verdict (the roofline reports the probe), not the suite's fp32 pin
    unpinned = {key: value for key, value in os.environ.items() if key != "LIGHTNING_GRPO_PRECISION"}
    env = unpinned | {"LIGHTNING_GRPO_CACHE": str(out / "cache"), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "benchmarks/roofline.py", *QUICK, "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "roofline.json").read_text()), done.stdout, out


@pytest.mark.timeout(300)
def test_every_stage_has_a_finite_positive_fraction_of_its_bound(report):
    data, _, _ = report
    rows = data["rows"]
    for stage in STAGES:
        assert any(row["stage"].startswith(stage) for row in rows), f"no row for {stage!r}"
    for row in rows:
        assert math.isfinite(row["fraction"]) and row["fraction"] > 0, row
        assert row["fraction"] == pytest.approx(row["measured"] / row["bound"])
    kinds = {row["bound_kind"].split(",")[0] for row in rows if row["group"] == "generator"}
    assert kinds == {"compute", "bandwidth"}  # decode against both bounds
    dtypes = {row["stage"].rsplit(", ", 1)[1] for row in rows if row["group"] == "generator"}
    assert dtypes == {"fp32", "bf16"}  # the generator in each dtype
    precisions = {row["stage"].rsplit(", ", 1)[1] for row in rows if row["group"] in ("train", "reference")}
    assert precisions == {"32-true", "bf16-mixed"}  # the train step and the reference forward in each precision
    autocast = {row["stage"] for row in rows if row["stage"].endswith("bf16-mixed")}
    against_bf16 = {row["stage"] for row in rows if "bf16 peak" in row["bound_kind"]}
    assert autocast and autocast <= against_bf16  # autocast's products are held to the bf16 peak


@pytest.mark.timeout(300)
def test_the_peaks_and_the_machine_are_recorded(report):
    data, _, _ = report
    peaks = data["peaks"]
    assert set(peaks["peak_gflops"]) == {"fp32", "bf16"} and peaks["best_dtype"] in ("fp32", "bf16")
    assert all(
        v > 0 and math.isfinite(v) for v in [*peaks["peak_gflops"].values(), peaks["read_gbs"], peaks["copy_gbs"]]
    )
    for speeds in peaks["matmul_gflops"].values():  # each dtype's best of torch's linear and oneDNN's packed product
        assert {"fp32", "bf16", "fp32 linear", "bf16 linear"} <= set(speeds)
        assert all(speeds[d] == max(v for k, v in speeds.items() if k.startswith(f"{d} ")) for d in ("fp32", "bf16"))
    assert data["machine"].startswith("roofline: commit") and "load average" in data["machine"]
    assert "fp32" in data["precision_probe"] and data["parameters"] > 0


@pytest.mark.timeout(300)
def test_the_table_has_a_line_per_row_and_the_plot_is_written(report):
    data, stdout, out = report
    assert stdout.startswith("roofline: commit")
    table = stdout[stdout.index("| stage | measured | bound | fraction |") :].splitlines()
    lines = [line for line in table[2:] if line.startswith("| ")]
    assert len(lines) == len(data["rows"])
    for line, row in zip(lines, data["rows"], strict=True):
        assert line.startswith(f"| {row['stage']} |") and line.endswith(f"| {row['fraction']:.3f} |")
    assert (out / "roofline.png").stat().st_size > 10_000
