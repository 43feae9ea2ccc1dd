"""The main job's `reward.png` counts optimizer steps as its log does: a held-out point where the progress bar said
"Validation at step N" is drawn at N, the accuracy before training at 0, the first step's reward at 1. Checked on a
real main-job run of the smoke config (the tiny model), through the figure `plot_rewards` returns.
"""

from __future__ import annotations

import json
import re
import sys
from importlib.resources import files

import pandas as pd
import pytest

from lightning_grpo.cli.main_job import ACCURACY, main, optimizer_steps, plot_rewards

SMOKE = str(files("lightning_grpo.configs") / "smoke.yaml")


@pytest.mark.timeout(300)
def test_reward_plot_draws_each_validation_at_the_step_the_log_names(
    tmp_path, monkeypatch, capsys, no_leaked_processes
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["main_job"])
    summary = main(["--config", SMOKE])  # 4 optimizer steps, a validation every 2
    printed = capsys.readouterr()
    logged = re.findall(
        r"Validation at step (\d+) \[[^]]*\]: .*val/rewards/accuracy=([\d.]+)", printed.out + printed.err
    )
    # the main job's validation before training, then the fit's after steps 2 and 4
    assert [int(step) for step, _ in logged] == [0, 2, 4], printed.out[-3000:]

    log_dir = next((tmp_path / "smoke").glob("version_*"))
    figure = plot_rewards(log_dir / "metrics.csv", before=summary["accuracy_before"])
    lines = {line.get_label(): line for line in figure.axes[0].lines}
    held_out = lines["held-out greedy accuracy"]
    assert list(held_out.get_xdata()) == [int(step) for step, _ in logged]  # `before` is not drawn twice
    assert list(held_out.get_ydata()) == pytest.approx([float(value) for _, value in logged], abs=5e-4)
    trained = list(lines["training reward (per step)"].get_xdata())
    assert trained == list(range(1, summary["optimizer_steps"] + 1))
    assert json.loads((log_dir / "summary.json").read_text())["optimizer_steps"] == trained[-1]


def test_optimizer_steps_counts_a_validation_before_training_as_0():
    """The rows of a metrics.csv as Lightning writes them: a validation before the fit and one after the first step
    share the CSV's step 0; only their order tells them apart."""
    metrics = pd.DataFrame(
        {
            "step": [0, 0, 0, 1, 1],
            "epoch": [0, 0, 0, 0, 0],
            "reward": [None, 0.1, None, 0.2, None],
            ACCURACY: [0.0, None, 0.5, None, 0.75],
        }
    )
    assert optimizer_steps(metrics).tolist() == [0, 1, 1, 2, 2]
