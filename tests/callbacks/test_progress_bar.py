"""GRPOProgressBar's text: metrics at 3 significant digits, as Lightning's TQDM bar shows them, in its lines too."""

from __future__ import annotations

import re

import pytest
from helpers.tiny import cpu_trainer, tiny_datamodule, tiny_prompts

from lightning_grpo.callbacks import GRPOProgressBar
from lightning_grpo.callbacks.progress_bar import format_metric
from lightning_grpo.module import GRPOModule


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (0.7916666865348816, "0.792"),
        (12.0, "12.00"),
        (-0.5, "-0.50"),
        (1234.5678, "1.23e+3"),
        (1e-6, "1e-6"),
        (float("nan"), "nan"),
        (float("inf"), "inf"),
        (3, 3),
        ("text", "text"),
    ],
)
def test_format_metric_shows_a_float_as_lightnings_bar_does(value, shown):
    assert format_metric(value) == shown


@pytest.mark.timeout(240)
def test_lines_show_rewards_and_validation_metrics_at_3_significant_digits(capsys, no_leaked_processes):
    datamodule = tiny_datamodule(4, val_dataset=tiny_prompts(4), val_size=4)
    bar = GRPOProgressBar(lines=True)
    trainer = cpu_trainer(enable_progress_bar=True, callbacks=[bar], limit_val_batches=None)
    trainer.fit(GRPOModule("tiny-random", learning_rate=1e-3), datamodule=datamodule)
    lines = [line for line in capsys.readouterr().out.splitlines() if "groups" in line or "Validation" in line]
    text = "\n".join(lines)
    assert re.search(r" reward=[-\d.e+]+( |$)", text), text
    assert any(line.startswith("Validation") and "val/reward=" in line for line in lines), text
    assert "val/reward=" in lines[-1], text  # the last training line shows the validation metrics too
    # each float as the bar shows it: 3 significant digits (0.792, 0.0515, 12.00, 1.23e+3), never a raw float
    floats = [number for number in re.findall(r"=(-?\d[\d.e+-]*)", text) if not number.lstrip("-").isdigit()]
    assert floats, text
    assert all(format_metric(float(number)) == number for number in floats), text
