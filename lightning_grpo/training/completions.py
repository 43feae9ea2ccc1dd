"""The completions table: rows for a sample of one optimizer step's rollouts, written to every attached logger.

Each row is one training sample of the step: `step` (the step's row in `metrics.csv`), `group_id`, `prompt`,
`completion`, `reward` and each `rewards/<column>` (the trainer scorers' columns too; empty = not scored),
`advantage`, `staleness` (policy versions between the weights that sampled it and those it trained), `truncated`.

Where it goes, through Lightning's logger API: a `CSVLogger` gets `completions.csv` beside its `metrics.csv`
(`pandas.read_csv` reads it), a `TensorBoardLogger` a markdown table under the text tag `completions`, a
`WandbLogger` a `wandb.Table` (`WandbLogger.log_table`), an `MLFlowLogger` the run's artifact `completions.json`
(`MlflowClient.log_table`: each table appended, `mlflow.load_table` reads it back). Other loggers get nothing (said
once).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger, Logger, MLFlowLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.utilities import rank_zero_info

from ..pipeline.batch import StepBatch
from ..rollout.records import RolloutSample

#: File a `CSVLogger` gets the table in, beside `metrics.csv`.
COMPLETIONS_CSV = "completions.csv"
#: TensorBoard text tag and W&B table key.
COMPLETIONS_KEY = "completions"
#: MLflow artifact the tables are appended to.
COMPLETIONS_JSON = "completions.json"

Row = dict[str, Any]


def completion_rows(
    batch: StepBatch, *, step: int, policy_version: int, scored: Any = None, limit: int | None = None
) -> list[Row]:
    """Rows for up to `limit` of `batch.samples` (rank 0's), taken round-robin over the step's groups.

    Args:
        batch: rank 0's `StepBatch` of the step.
        step: the step's row in the metrics (Lightning's 0-based step).
        policy_version: the policy version the step trained (staleness is measured against it).
        scored: the step's `ScoredStep` when trainer scorers ran (their columns and advantages), else None.
        limit: how many rows; None: every sample of the step.
    """
    scores = _scored_columns(scored, rollout_columns=len(batch.reward_names))
    names = [f"rewards/{name}" for name in batch.reward_names]
    rows = []
    for uid in _round_robin(batch.samples, limit):
        sample = batch.samples[uid]
        row: Row = {
            "step": step,
            "group_id": sample.group_id,
            "prompt": _text(sample.prompt),
            "completion": _text(sample.completion),
            "reward": _number(sample.metrics.get("reward")),
            **{name: _number(sample.metrics.get(name)) for name in names},
            "advantage": _number(sample.advantage),
            "staleness": policy_version - sample.model_version,
            "truncated": bool(sample.truncated),
        }
        if scores is not None:
            columns, advantages = scores
            row.update({name: values.get(uid, math.nan) for name, values in columns.items()})
            row["advantage"] = advantages.get(uid, row["advantage"])
        rows.append(row)
    return rows


def log_completion_rows(trainer: pl.Trainer, rows: Sequence[Row], *, step: int) -> None:
    """Write `rows` to every logger of `trainer` that takes a table (see the module doc); rank 0 only."""
    if not rows or not trainer.is_global_zero:
        return
    for logger in trainer.loggers:
        _write(logger, list(rows), step)


def _write(logger: Logger, rows: list[Row], step: int) -> None:
    columns = list(rows[0])
    if isinstance(logger, CSVLogger):
        _append_csv(Path(logger.log_dir) / COMPLETIONS_CSV, columns, rows)
    elif isinstance(logger, TensorBoardLogger):
        logger.experiment.add_text(COMPLETIONS_KEY, markdown_table(columns, rows), global_step=step)
    elif isinstance(logger, WandbLogger):
        logger.log_table(key=COMPLETIONS_KEY, columns=columns, data=[list(row.values()) for row in rows], step=step)
    elif isinstance(logger, MLFlowLogger):
        table = {column: [row.get(column) for row in rows] for column in columns}
        logger.experiment.log_table(logger.run_id, data=table, artifact_file=COMPLETIONS_JSON)
    else:
        _say_once(type(logger).__name__)


def _append_csv(path: Path, columns: list[str], rows: list[Row]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    with path.open("a", newline="", encoding="utf-8") as file:
        writer = csv.DictWriter(file, fieldnames=columns, extrasaction="ignore")
        if new:
            writer.writeheader()
        writer.writerows(rows)


def markdown_table(columns: list[str], rows: list[Row]) -> str:
    """A markdown table (TensorBoard's text plugin renders it); `|` and line breaks in cells are escaped."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            value = "" if math.isnan(value) else f"{value:.4g}"
        return str(value).replace("|", "\\|").replace("\r", "").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(column, "")) for column in columns) + " |" for row in rows]
    return "\n".join(lines)


_unsupported: set[str] = set()


def _say_once(name: str) -> None:
    if name not in _unsupported:
        _unsupported.add(name)
        rank_zero_info(
            f"The completions table is not written to {name} (CSV, TensorBoard, W&B and MLflow loggers get it)."
        )


def _round_robin(samples: list[RolloutSample], limit: int | None) -> list[int]:
    """Sample indices, one per group in turn (so a short table shows several prompts), at most `limit`."""
    by_group: dict[int, list[int]] = {}
    for uid, sample in enumerate(samples):
        by_group.setdefault(sample.group_id, []).append(uid)
    queues = list(by_group.values())
    order = [queue[i] for i in range(max(map(len, queues), default=0)) for queue in queues if i < len(queue)]
    return order if limit is None else order[:limit]


def _scored_columns(
    scored: Any, *, rollout_columns: int
) -> tuple[dict[str, dict[int, float]], dict[int, float]] | None:
    """The trainer scorers' columns (after the `rollout_columns` first) and the scored advantages, by `sample_uid`."""
    if scored is None:
        return None
    uids = [int(uid) for uid in scored.uids]
    columns = {
        f"rewards/{name}": dict(zip(uids, map(_number, scored.rewards[:, k]), strict=True))
        for k, name in enumerate(scored.reward_names)
        if k >= rollout_columns
    }
    return columns, dict(zip(uids, map(_number, scored.advantages), strict=True))


def _text(value: Any) -> str:
    """A prompt or completion as text: a string as it is; chat messages as their contents ("role: content" lines
    when there is more than one message)."""
    if isinstance(value, str):
        return value
    messages = [m for m in value if isinstance(m, dict)]
    contents = [_content(m.get("content")) for m in messages]
    if len(messages) == 1:
        return contents[0]
    return "\n".join(f"{m.get('role', '?')}: {c}" for m, c in zip(messages, contents, strict=True))


def _content(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def _number(value: Any) -> float:
    return math.nan if value is None else float(value)
