"""`lightning-grpo fit --trainer.accumulate_grad_batches` and `--trainer.gradient_clip_val`: the smoke config trains
with them moved onto `data.gradient_accumulation_steps` and `model.max_grad_norm`; a value we cannot map exits 2 with
one line naming our option, before any process is started."""

from __future__ import annotations

from importlib.resources import files

import pytest
import yaml
from helpers.optimizer_probe import OptimizerStepProbe

from lightning_grpo.cli import cli, main

SMOKE = str(files("lightning_grpo.configs") / "smoke.yaml")
PROBE = "--trainer.callbacks+=helpers.optimizer_probe.OptimizerStepProbe"


def fit_one_step(*options: str):
    done = cli(["fit", "--config", SMOKE, "--trainer.max_steps", "1", PROBE, *options])
    probe = next(c for c in done.trainer.callbacks if isinstance(c, OptimizerStepProbe))
    return done, probe


def saved_config(tmp_path) -> dict:
    return yaml.safe_load(next((tmp_path / "smoke").glob("version_*/config.yaml")).read_text())


@pytest.mark.timeout(240)
def test_accumulate_grad_batches_trains_that_many_micro_batches_per_step(tmp_path, in_process, no_leaked_processes):
    done, probe = fit_one_step("--trainer.accumulate_grad_batches", "2")
    assert done.trainer.global_step == 1 and probe.micro_batches == [2]  # the smoke config's steps have 1 otherwise
    assert done.datamodule.hparams.gradient_accumulation_steps == 2
    config = saved_config(tmp_path)  # what the run used, so `--config config.yaml` runs it again
    assert config["data"]["gradient_accumulation_steps"] == 2 and config["trainer"]["accumulate_grad_batches"] == 1


@pytest.mark.timeout(240)
def test_gradient_clip_val_clips_the_gradient_norm_to_it(tmp_path, in_process, no_leaked_processes):
    done, probe = fit_one_step("--trainer.gradient_clip_val", "0.001")
    assert done.trainer.global_step == 1 and probe.gradient_norms == pytest.approx([1e-3], rel=1e-3)
    assert probe.micro_batches == [1] and done.model.hparams.max_grad_norm == 1e-3
    config = saved_config(tmp_path)
    assert config["model"]["max_grad_norm"] == 1e-3 and config["trainer"]["gradient_clip_val"] is None


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (
            ["--trainer.gradient_clip_val", "1.0", "--trainer.gradient_clip_algorithm", "value"],
            "`trainer.gradient_clip_algorithm='value'` is not supported: GRPOModule clips the gradient norm to its "
            "`model.max_grad_norm=1.0`",
        ),
        (
            ["--trainer.accumulate_grad_batches", "2", "--data.gradient_accumulation_steps", "3"],
            "`trainer.accumulate_grad_batches=2` and `data.gradient_accumulation_steps=3` disagree",
        ),
        (
            ["--trainer.gradient_clip_val", "0.5", "--model.max_grad_norm", "2.0"],
            "`trainer.gradient_clip_val=0.5` and `model.max_grad_norm=2.0` disagree",
        ),
    ],
    ids=["clip_by_value", "accumulation_both_ways", "clip_both_ways"],
)
def test_a_flag_we_cannot_map_exits_2_with_one_line_naming_our_option(
    options, named, capsys, in_process, started_processes
):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", SMOKE, *options])
    error = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in error
    message = error[error.rindex("error: ") :].strip()
    assert named in message and len(message.splitlines()) == 1, error[-2000:]
    assert started_processes == []
