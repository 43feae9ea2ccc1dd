"""Experiment trackers for real: `lightning-grpo fit` on the smoke config with the tracker switched on by the config's
own commented `logger:` list (the CSV logger beside W&B or MLflow), a real fit of the tiny model, and the tracker's
run read back from its own files by its own code: every metric of every step equals the CSV logger's, and W&B holds
the completions table.

W&B runs offline (`WANDB_MODE=offline`: no account, nothing sent); its run file is decoded with wandb's own protobuf
`Record`. MLflow writes to a sqlite store read back through `mlflow.tracking.MlflowClient`. Both are optional extras
(`pip install -e '.[wandb,mlflow]'`); without them these tests skip and say so.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Iterator
from importlib.resources import files
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import yaml

from lightning_grpo.cli import cli

SMOKE = Path(str(files("lightning_grpo.configs") / "smoke.yaml"))
NOT_METRICS = {"step", "epoch"}


def commented_loggers(config: Path, tracker: str) -> list[dict[str, Any]]:
    """The commented-out `logger:` list in `config` that names `tracker`, uncommented (the one users copy)."""
    blocks: list[list[str]] = []
    current: list[str] | None = None
    for line in config.read_text().splitlines():
        if line.strip() == "# logger:":
            current = ["logger:"]
            blocks.append(current)
        elif current is not None and line.startswith("  #   "):
            current.append(line.replace("  # ", "", 1))
        else:
            current = None
    (block,) = [block for block in blocks if any(tracker in line for line in block)]
    return yaml.safe_load("\n".join(block))["logger"]


def fit_with(tmp_path: Path, tracker: str) -> Any:
    """Two optimizer steps of the smoke config (validation after the second) with `tracker` beside the CSV logger."""
    loggers = commented_loggers(SMOKE, tracker)
    assert [logger["class_path"].rsplit(".", 1)[1] for logger in loggers] == ["CSVLogger", tracker]
    (tmp_path / "tracker.yaml").write_text(yaml.safe_dump({"trainer": {"logger": loggers}}))
    args = ["fit", "--config", str(SMOKE), "--config", str(tmp_path / "tracker.yaml"), "--trainer.max_steps", "2"]
    done = cli([*args, "--trainer.enable_progress_bar", "false"])
    assert done.trainer.global_step == 2
    return done


def csv_rows(done: Any) -> dict[int, dict[str, float]]:
    """The CSV logger's metrics: step -> every metric logged at that step."""
    metrics = pd.read_csv(Path(done.trainer.loggers[0].log_dir) / "metrics.csv")
    rows: dict[int, dict[str, float]] = {}
    for record in metrics.to_dict("records"):
        values = {k: v for k, v in record.items() if k not in NOT_METRICS and not pd.isna(v)}
        rows.setdefault(int(record["step"]), {}).update(values)
    return rows


def assert_same_metrics(tracked: dict[int, dict[str, float]], csv: dict[int, dict[str, float]]) -> None:
    assert set(csv) == {0, 1} and "reward" in csv[0] and "val/reward" in csv[1], csv
    for step, values in csv.items():
        differ = {k: (v, tracked.get(step, {}).get(k)) for k, v in values.items()}
        differ = {k: pair for k, pair in differ.items() if pair[1] is None or not math.isclose(*pair, rel_tol=1e-6)}
        assert not differ, f"step {step}: (csv, tracker) {differ}"


# -- W&B -------------------------------------------------------------------------------------------------------------

_BLOCK = 32 * 1024  # the run file is a LevelDB-style log: 32 KiB blocks of (crc32, length, type) framed chunks
_FULL, _LAST = 1, 4


def wandb_records(path: Path) -> Iterator[Any]:
    """The records of an offline W&B run file (`run-<id>.wandb`), as wandb's own protobuf `Record`s."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    position, chunks = 7, []  # after the header: ":W&B", magic 0xBEE1, version
    while position + 7 <= len(data):
        left = _BLOCK - position % _BLOCK
        _crc, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if left < 7 or (kind == 0 and length == 0):  # a block's padding
            position += left
            continue
        chunks.append(data[position + 7 : position + 7 + length])
        position += 7 + length
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(chunks))
            chunks = []
            yield record


def read_completions(done: Any) -> pd.DataFrame:
    """The run's `completions.csv`, an empty prompt or completion read as '' (as the trackers hold it), not NaN."""
    completions = pd.read_csv(Path(done.trainer.loggers[0].log_dir) / "completions.csv")
    return completions.fillna({"prompt": "", "completion": ""})


def wandb_history(run_dir: Path) -> list[dict[str, Any]]:
    """Each `run.log` call of the run: its keys (nested ones joined by '/') and values."""
    (run_file,) = run_dir.glob("run-*.wandb")
    return [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        for record in wandb_records(run_file)
        if record.WhichOneof("record_type") == "history"
    ]


@pytest.mark.timeout(300)
def test_wandb_offline_run_holds_every_metric_of_every_step_and_the_completions_table(
    tmp_path, monkeypatch, in_process, no_leaked_processes
):
    wandb = pytest.importorskip("wandb", reason="W&B is an optional extra: pip install -e '.[wandb]'")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    try:
        done = fit_with(tmp_path, "WandbLogger")
        wandb.finish()
    finally:
        wandb.teardown()  # stops wandb's service process
    (run_dir,) = tmp_path.glob("wandb/offline-run-*")
    history = wandb_history(run_dir)

    tracked: dict[int, dict[str, Any]] = {}
    for row in history:
        tracked.setdefault(row["trainer/global_step"], {}).update(row)
    assert_same_metrics(tracked, csv_rows(done))

    completions = read_completions(done)
    tables = [row for row in history if "completions/path" in row]
    assert [row["trainer/global_step"] for row in tables] == sorted(completions["step"].unique()) == [0, 1]
    for row in tables:
        table = json.loads((run_dir / "files" / row["completions/path"]).read_text())
        logged = pd.DataFrame(table["data"], columns=table["columns"])
        expected = completions[completions["step"] == row["trainer/global_step"]]
        assert list(logged.columns) == list(completions.columns)
        for column in ("step", "group_id", "prompt", "completion", "staleness"):
            assert logged[column].tolist() == expected[column].tolist(), column
        assert logged["reward"].tolist() == pytest.approx(expected["reward"].tolist())


# -- MLflow ----------------------------------------------------------------------------------------------------------


def mlflow_name(key: str) -> str:
    """The name `MLFlowLogger` logs `key` under: MLflow takes letters, digits and `_/. -` only (`val/pass@1` is
    `val/pass1`)."""
    return re.sub(r"[^a-zA-Z0-9_/. -]+", "", key)


@pytest.mark.filterwarnings("ignore:MLFlow only allows")  # the renaming `mlflow_name` checks
@pytest.mark.timeout(300)
def test_mlflow_sqlite_run_holds_every_metric_of_every_step_the_hyperparameters_and_the_completions_table(
    tmp_path, in_process, no_leaked_processes
):
    pytest.importorskip("mlflow", reason="MLflow is an optional extra: pip install -e '.[mlflow]'")
    pytest.importorskip("sqlalchemy", reason="MLflow's sqlite store needs the [mlflow] extra's sqlalchemy")
    from mlflow.tracking import MlflowClient

    done = fit_with(tmp_path, "MLFlowLogger")
    client = MlflowClient("sqlite:///mlflow.db")  # the config's tracking_uri, in the run's folder
    experiment = client.get_experiment_by_name("lightning-grpo")
    (run,) = client.search_runs([experiment.experiment_id])
    assert (run.info.run_name, run.info.status) == ("smoke", "FINISHED")

    csv = csv_rows(done)
    tracked: dict[int, dict[str, float]] = {}
    for key in {key for values in csv.values() for key in values}:
        for metric in client.get_metric_history(run.info.run_id, mlflow_name(key)):
            tracked.setdefault(metric.step, {})[key] = metric.value
    assert_same_metrics(tracked, csv)
    assert mlflow_name("val/pass@1") == "val/pass1" and "val/pass@1" in csv[1]
    assert float(run.data.params["learning_rate"]) == done.model.hparams.learning_rate == 1e-3

    table = json.loads(Path(client.download_artifacts(run.info.run_id, "completions.json", str(tmp_path))).read_text())
    logged = pd.DataFrame(table["data"], columns=table["columns"])
    completions = read_completions(done)
    assert sorted(logged["step"].unique()) == sorted(completions["step"].unique()) == [0, 1]
    assert list(logged.columns) == list(completions.columns)
    for column in ("step", "group_id", "prompt", "completion", "staleness"):
        assert logged[column].tolist() == completions[column].tolist(), column
    assert logged["reward"].tolist() == pytest.approx(completions["reward"].tolist())
