"""The main job's driver (`python -m lightning_grpo.cli.main_job`), run on the smoke config: the tiny random model stands
in for SmolLM2 (tests/test_smollm2.py proves the real model path; the README records a full run)."""

from __future__ import annotations

import json
import math
import sys
from importlib.resources import files
from pathlib import Path

import pandas as pd
import pytest

from lightning_grpo.cli.main_job import ACCURACY, main

SMOKE = str(files("lightning_grpo.configs") / "smoke.yaml")
PROGRESS = ("Training: ", "Validation at step ")


@pytest.mark.timeout(300)
def test_main_job_reports_accuracy_before_and_after_with_a_plot_and_summary(
    tmp_path, monkeypatch, capsys, no_leaked_processes
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["main_job"])
    summary = main(["--config", SMOKE])
    captured = capsys.readouterr()
    printed = captured.out
    assert "held-out accuracy before training" in printed and "held-out accuracy after training" in printed

    # One screen besides the progress lines (no terminal here: lines, not a bar), ending with where things are.
    screen = [line for line in (captured.out + captured.err).splitlines() if not line.startswith(PROGRESS)]
    assert len(screen) <= 12, "\n".join(screen)
    assert [line.split(":")[0] for line in printed.splitlines()[-4:]] == [
        "metrics",
        "completions table",
        "reward plot",
        "summary",
    ]
    assert all(Path(line.split(":", 1)[1].strip()).is_file() for line in printed.splitlines()[-4:])

    log_dir = next((tmp_path / "smoke").glob("version_*"))
    assert json.loads((log_dir / "summary.json").read_text()) == summary
    assert (log_dir / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert summary["groups_consumed"] == 8 and summary["optimizer_steps"] >= 1
    assert 0 <= summary["accuracy_before"] <= 1 and 0 <= summary["accuracy_after"] <= 1
    assert summary["peak_rss_gb"] > 0 and summary["fit_minutes"] > 0
    assert pd.read_csv(summary["completions_csv"])["step"].nunique() >= 2  # the first and the last step at least

    # "after" is the validation the fit ran after its last step, when the stream ended it, not a second pass over
    # the held-out prompts (Lightning logs it under that step's row).
    metrics = pd.read_csv(log_dir / "metrics.csv")
    validations = metrics.dropna(subset=[ACCURACY])
    last_step = metrics.dropna(subset=["loss"])["step"]
    assert len(last_step) == summary["optimizer_steps"] and validations["step"].max() == last_step.max()
    assert math.isclose(validations[ACCURACY].iloc[-1], summary["accuracy_after"], abs_tol=1e-6)


@pytest.mark.timeout(300)
def test_with_allow_stall_a_fit_that_trains_nothing_is_reported_not_raised(tmp_path, monkeypatch, no_leaked_processes):
    """A constant reward leaves every group without a signal; by default the stall is raised (the DDP fit test), and
    with `allow_stall` (what the recipes use) the job reports it and keeps the policy's validation."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["main_job"])
    rewards = "[helpers.fit_rewards.constant_reward]"
    summary = main(
        ["--config", SMOKE, "--data.reward_funcs", rewards], held_out="val/rewards/constant_reward", allow_stall=True
    )
    assert summary["optimizer_steps"] == 0 and summary["groups_consumed"] == 8
    assert "8 prompt groups in a row" in summary["stall"] and "no_signal: 8" in summary["stall"]
    # the policy the stall left is the one validated before
    assert summary["accuracy_after"] == summary["accuracy_before"] == 1.0
    log_dir = next((tmp_path / "smoke").glob("version_*"))
    assert json.loads((log_dir / "summary.json").read_text()) == summary
