"""The completions table: which samples become rows and what a row holds, and how each logger gets it (a real
CSVLogger and TensorBoardLogger; W&B and MLflow are read back by their own clients in `tests/cli/test_trackers.py`)."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import numpy as np
import pandas as pd
import pytest
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightning_grpo.pipeline.batch import StepBatch
from lightning_grpo.rollout.records import RolloutSample
from lightning_grpo.scoring.step import ScoredStep
from lightning_grpo.training.completions import COMPLETIONS_CSV, completion_rows, log_completion_rows, markdown_table


def sample(group_id: int, index: int, *, version: int = 3, fmt: float | None = 1.0) -> RolloutSample:
    return RolloutSample(
        prompt=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Q{group_id}"}],
        completion=[{"role": "assistant", "content": f"A{group_id}.{index} | done\nnext"}],
        input_ids=np.arange(4),
        completion_mask=np.array([0, 0, 1, 1]),
        old_log_probs=np.zeros(4, dtype=np.float32),
        advantage=0.5 * index - 0.5,
        model_version=version,
        group_id=group_id,
        metrics={"reward": float(index), "rewards/acc": float(index), "rewards/fmt": math.nan if fmt is None else fmt},
        truncated=index == 2,
    )


def step_batch() -> StepBatch:
    samples = [sample(7, i, version=3) for i in range(3)] + [sample(9, i, version=4, fmt=None) for i in range(3)]
    return StepBatch(group_ids=[7, 9], reward_names=["acc", "fmt"], samples=samples)


def test_rows_hold_each_column_and_a_limit_takes_the_groups_in_turn():
    rows = completion_rows(step_batch(), step=11, policy_version=5, limit=4)
    assert [(row["group_id"], row["reward"]) for row in rows] == [(7, 0.0), (9, 0.0), (7, 1.0), (9, 1.0)]
    first = rows[0]
    assert first["step"] == 11 and first["staleness"] == 2 and rows[1]["staleness"] == 1
    assert first["prompt"] == "system: Be brief.\nuser: Q7" and first["completion"] == "A7.0 | done\nnext"
    assert first["advantage"] == -0.5 and first["truncated"] is False
    assert math.isnan(rows[1]["rewards/fmt"])  # not scored stays NaN
    assert len(completion_rows(step_batch(), step=0, policy_version=5)) == 6  # no limit: the whole step


def test_trainer_scorer_columns_and_their_advantages_are_in_the_rows():
    batch = step_batch()
    scored = ScoredStep(
        reward_names=["acc", "fmt", "rm"],
        uids=np.array([3, 4, 5]),
        rewards=np.array([[0.0, np.nan, 0.1], [1.0, np.nan, 0.2], [2.0, np.nan, np.nan]]),
        advantages=np.array([-1.0, 0.0, 1.0]),
        trained=np.array([True, False, True]),
    )
    rows = completion_rows(batch, step=0, policy_version=4, scored=scored)
    by_uid = {(row["group_id"], row["reward"]): row for row in rows}
    assert by_uid[(9, 1.0)]["rewards/rm"] == 0.2 and by_uid[(9, 1.0)]["advantage"] == 0.0
    assert math.isnan(by_uid[(9, 2.0)]["rewards/rm"]) and math.isnan(by_uid[(7, 0.0)]["rewards/rm"])


def test_markdown_cells_escape_pipes_and_line_breaks():
    table = markdown_table(["completion", "reward"], [{"completion": "a | b\nc", "reward": math.nan}])
    assert table.splitlines() == ["| completion | reward |", "|---|---|", "| a \\| b<br>c |  |"]


@pytest.mark.timeout(60)
def test_a_csv_logger_gets_a_file_pandas_reads_and_tensorboard_gets_the_text(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    csv, tensorboard = CSVLogger(tmp_path, name="csv"), TensorBoardLogger(tmp_path, name="tb")
    trainer = pl.Trainer(logger=[csv, tensorboard], enable_progress_bar=False)
    for step in (0, 4):
        log_completion_rows(trainer, completion_rows(step_batch(), step=step, policy_version=5), step=step)
    table = pd.read_csv(f"{csv.log_dir}/{COMPLETIONS_CSV}")
    assert table["step"].tolist() == [0] * 6 + [4] * 6
    assert table["completion"].iloc[0] == "A7.0 | done\nnext" and table["rewards/fmt"].isna().sum() == 6
    tensorboard.experiment.flush()
    events = EventAccumulator(tensorboard.log_dir)
    events.Reload()
    texts = events.Tensors("completions/text_summary")
    assert [t.step for t in texts] == [0, 4] and b"A7.0 \\| done<br>next" in texts[0].tensor_proto.string_val[0]
