"""StepMetrics under a real `Trainer.fit`: each optimizer step is one logger row holding only that step's values, and
`*_total` increments become the run's totals, in every row and across a checkpoint."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pandas as pd
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_grpo.training.step_metrics import StepMetrics, is_counter, log_step_metrics

#: What each of four steps measures: a gauge only on some steps, a counter's increments (0 on a step without one).
PLAN = [{"gauge": 1.0, "faults_total": 2.0}, {"faults_total": 0.0}, {"gauge": 3.0, "faults_total": 1.0}, {}]


class PlannedMetrics(pl.LightningModule):
    """A linear model trained with manual optimization whose step metrics go through `StepMetrics`, as GRPOModule's."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.automatic_optimization = False
        self.step_metrics = StepMetrics()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        optimizer = self.optimizers()
        self.manual_backward(self.layer(batch).sum())
        optimizer.step()
        optimizer.zero_grad()
        log_step_metrics(self, PLAN[batch_idx])

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.step_metrics.flush(self.trainer)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(tmp_path, log_every_n_steps: int) -> tuple[pd.DataFrame, pl.Trainer]:
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=1,
        logger=CSVLogger(tmp_path),
        log_every_n_steps=log_every_n_steps,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = torch.utils.data.DataLoader(torch.ones(len(PLAN), 1), batch_size=1)
    trainer.fit(PlannedMetrics(), train_dataloaders=data)
    return pd.read_csv(trainer.logger.log_dir + "/metrics.csv"), trainer


@pytest.mark.timeout(60)
def test_a_step_without_a_value_has_none_in_its_row_and_counters_are_totals(tmp_path):
    rows, trainer = fit(tmp_path, log_every_n_steps=1)
    assert rows["step"].tolist() == [0, 1, 2, 3]  # one row per optimizer step, Lightning's step numbers
    assert [None if math.isnan(v) else v for v in rows["gauge"]] == [1.0, None, 3.0, None]  # never step 0's again
    assert rows["faults_total"].tolist() == [2.0, 2.0, 3.0, 3.0]
    assert float(trainer.callback_metrics["gauge"]) == 3.0  # callbacks and the progress bar still see the values


@pytest.mark.timeout(60)
def test_rows_follow_log_every_n_steps_and_the_totals_count_every_step(tmp_path):
    rows, _ = fit(tmp_path, log_every_n_steps=2)
    assert rows["step"].tolist() == [1, 3]
    assert rows["faults_total"].tolist() == [2.0, 3.0]
    assert "gauge" not in rows  # steps 1 and 3 (0-based) measured no gauge


def test_totals_round_trip_through_a_checkpoint_state():
    metrics = StepMetrics()
    metrics.totals = {"reward_pool/errors_total": 3.0}
    restored = StepMetrics()
    restored.load_state_dict(metrics.state_dict())
    assert restored.totals == {"reward_pool/errors_total": 3.0}
    StepMetrics().load_state_dict({})  # a checkpoint from before the totals existed


@pytest.mark.parametrize(
    ("key", "counter"),
    [
        ("reward_pool/errors_total", True),
        ("tools/search/call_total", True),
        ("progress/dropped_no_signal_total", True),
        ("rollout/generated_tok_s", False),
        ("totals/mean", False),
    ],
)
def test_counters_are_named_by_a_total_word_in_the_last_part(key, counter):
    assert is_counter(key) is counter
