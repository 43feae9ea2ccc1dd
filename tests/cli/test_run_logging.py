"""What a run records, end to end through `lightning-grpo fit` and a resume: counters that are run totals, per-step
metrics logged once per step, the completions table, TensorBoard, a cosine schedule from YAML, and the progress lines
of a run without a terminal.

One fit of the tiny model on 6 prompts, whose second reward function raises on one prompt, hangs past the reward
timeout on another and kills its worker process on a third, writes metrics to a CSV and a TensorBoard logger; the run
is then resumed from its last checkpoint for a second epoch, where the same faults happen again. Both are the
installed command in their own process session (`run_in_session`: a hang fails, a process left behind fails).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml
from helpers.learning_rates import learning_rates
from helpers.processes import run_in_session

REWARDS = Path(__file__).parents[1] / "scripts" / "faulty_rewards.py"
FAULTS = ["raise", "hang", "kill", "", "", ""]
T_MAX = 8
LR = 1e-3
#: Per epoch: 6 groups x 2 reward functions; `raise` and `kill` (its retry dies too) score NaN as errors; `hang` is
#: one timeout; the hung worker and the killed one and its retry's are three restarts.
PER_EPOCH = {"calls_total": 12.0, "errors_total": 2.0, "timeouts_total": 1.0, "restarts_total": 3.0}


def config(out: Path) -> dict:
    logger = {"save_dir": str(out)}
    return {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "limit_val_batches": 0,
            "logger": [
                {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {**logger, "name": "csv"}},
                {"class_path": "lightning.pytorch.loggers.TensorBoardLogger", "init_args": {**logger, "name": "tb"}},
            ],
            "callbacks": [
                {
                    "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                    "init_args": {"dirpath": str(out / "ckpt"), "save_last": True},
                },
                {"class_path": "lightning_grpo.callbacks.WeightSyncCallback", "init_args": {"every_n_steps": 2}},
                {
                    "class_path": "lightning_grpo.callbacks.CompletionsTableCallback",
                    "init_args": {"log_completions_every_n_steps": 1},
                },
            ],
        },
        "model": {
            "model": "tiny-random",
            "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": LR}},
            "lr_scheduler": {"class_path": "torch.optim.lr_scheduler.CosineAnnealingLR", "init_args": {"T_max": T_MAX}},
        },
        "data": {
            "dataset": str(out / "prompts.jsonl"),
            "reward_funcs": ["helpers.fit_rewards.char_sum_reward", "faulty_rewards.flaky"],
            "num_generations": 4,
            "max_completion_length": 8,
            "samples_per_row": 8,
            "reward_timeout": 2.0,
        },
    }


def fit(out: Path, *args: str, log: str) -> str:
    """`python -m lightning_grpo.cli fit ...` from `out` (so `faulty_rewards` imports, as a user's own module; the
    session has `tests/` on its `PYTHONPATH` for `helpers.fit_rewards`)."""
    command = [sys.executable, "-m", "lightning_grpo.cli", "fit", "--config", str(out / "config.yaml"), *args]
    code, output = run_in_session(command, log=out / log, timeout=240, cwd=out)
    assert code == 0, output[-4000:]
    return output


def cosine_rates(steps: int) -> list[float]:
    """The learning rate of each optimizer step under torch's own CosineAnnealingLR."""
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    return learning_rates(optimizer, torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=T_MAX), steps)


def training_rows(log_dir: Path) -> pd.DataFrame:
    metrics = pd.read_csv(log_dir / "metrics.csv")
    return metrics.dropna(subset=["loss"]).reset_index(drop=True)


def check_run(rows: pd.DataFrame, epochs: int) -> None:
    for name, per_epoch in PER_EPOCH.items():
        column = rows[f"reward_pool/{name}"]
        assert column.notna().all(), f"{name} has no value at some step"
        assert column.is_monotonic_increasing, column.tolist()
        assert column.iloc[-1] == per_epoch * epochs, (name, column.tolist())
    assert rows["step"].is_unique  # one row per optimizer step
    # Pushed every 2nd step, so logged at those steps only: never the previous push's value again.
    pushed = rows["perf/weight_sync_s"].notna()
    assert pushed.tolist() == [(step + 1) % 2 == 0 for step in rows["step"]], rows[["step", "perf/weight_sync_s"]]
    expected = cosine_rates(int(rows["step"].max()) + 1)
    assert rows["lr"].tolist() == pytest.approx([expected[s] for s in rows["step"]], rel=1e-9)


def check_completions(log_dir: Path, rows: pd.DataFrame) -> None:
    table = pd.read_csv(log_dir / "completions.csv")
    assert sorted(table["step"].unique()) == sorted(rows["step"]), "every step of this run was logged"
    means = table.groupby("step")["reward"].mean()
    assert means.tolist() == pytest.approx(rows.set_index("step").loc[means.index, "reward"].tolist(), rel=1e-6)
    faulty = table[table["prompt"].isin(["Say 0.", "Say 1.", "Say 2."])]
    assert len(faulty) and faulty["rewards/flaky"].isna().all()  # not scored: NaN, never 0
    assert (table[~table.index.isin(faulty.index)]["rewards/flaky"] == 1.0).all()
    assert {"completion", "rewards/char_sum_reward", "advantage", "staleness", "truncated"} <= set(table.columns)


def check_tensorboard(log_dir: Path, rows: pd.DataFrame) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    rewards = {e.step: e.value for e in events.Scalars("reward")}
    assert rewards == pytest.approx(dict(zip(rows["step"], rows["reward"], strict=True)), rel=1e-6)
    assert events.Scalars("reward_pool/errors_total")[-1].value == rows["reward_pool/errors_total"].iloc[-1]
    texts = events.Tensors("completions/text_summary")
    assert sorted(t.step for t in texts) == sorted(rows["step"])
    assert b"| prompt | completion |" in texts[0].tensor_proto.string_val[0]


def check_progress_lines(output: str, total: int) -> None:
    assert "\r" not in output, "no carriage returns without a terminal"
    lines = [line for line in output.splitlines() if line.startswith("Training: ")]
    assert 1 <= len(lines) <= 12, lines
    assert re.match(rf"Training: {total}/{total} groups \(100%\)", lines[-1]), lines[-1]


@pytest.mark.timeout(600)
def test_faults_are_counted_as_run_totals_across_a_resume_with_a_cosine_schedule_tables_and_tensorboard(tmp_path):
    shutil.copy(REWARDS, tmp_path / "faulty_rewards.py")
    rows = [{"prompt": f"Say {i}.", "fault": fault} for i, fault in enumerate(FAULTS)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config(tmp_path)))

    output = fit(tmp_path, log="run1.txt")
    first = training_rows(tmp_path / "csv" / "version_0")
    check_run(first, epochs=1)
    check_completions(tmp_path / "csv" / "version_0", first)
    check_tensorboard(tmp_path / "tb" / "version_0", first)
    check_progress_lines(output, total=6)

    # A second epoch from the last checkpoint: the totals carry on, and so does the schedule.
    output = fit(tmp_path, "--ckpt_path", str(tmp_path / "ckpt" / "last.ckpt"), "--data.epochs", "2", log="run2.txt")
    second = training_rows(tmp_path / "csv" / "version_1")
    assert second["step"].min() == first["step"].max() + 1
    assert all(second[f"reward_pool/{n}"].iloc[0] >= first[f"reward_pool/{n}"].iloc[-1] for n in PER_EPOCH)
    check_run(second, epochs=2)
    check_completions(tmp_path / "csv" / "version_1", second)
    check_progress_lines(output, total=12)
    assert not math.isnan(second["reward"].iloc[-1])
