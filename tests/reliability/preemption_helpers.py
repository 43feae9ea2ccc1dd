"""What the preemption tests put into a real `lightning-grpo fit`: the suite's step recorder, a step that can be held,
a slow reward (imported by the trainer and the reward workers through PYTHONPATH), and the fit's processes started
with `helpers.processes` (one command, or one command per rank, each in its own session)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from helpers.fit_script import rank_results
from helpers.processes import Session, start_session

from lightning_grpo.rewards import numeric_closeness

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
GROUPS = 8  # smoke: 8 prompts; 2 groups per optimizer step (on one rank, and on two ranks of one group each)


def slow_closeness(completions: list, **kwargs: Any) -> list[float | None]:
    """`numeric_closeness`, after `GRPO_TEST_REWARD_SLEEP` seconds: the trainer spends its time waiting for rollouts."""
    time.sleep(float(os.environ.get("GRPO_TEST_REWARD_SLEEP", "0")))
    return numeric_closeness(completions, **kwargs)


def run_config(
    tmp_path: Path,
    out: Path,
    *,
    devices: int = 1,
    hold_step: int = -1,
    hold_s: float = 0.0,
    checkpoint_dir: Path | None = None,
) -> Path:
    """The smoke config with the step recorder (records in `out`), `slow_closeness` and no validation; with
    `checkpoint_dir`, a checkpoint after every step there. With `devices=2`, DDP on gloo, one group per rank's row."""
    config = yaml.safe_load((REPO / "lightning_grpo/configs/smoke.yaml").read_text())
    recorder = {"out": str(out), "hold_step": hold_step, "hold_s": hold_s}
    config["trainer"].update(
        enable_progress_bar=False,
        limit_val_batches=0,
        val_check_interval=None,
        logger=False,
        callbacks=[{"class_path": "helpers.fit_probe.StepRecorder", "init_args": recorder}],
    )
    if devices > 1:
        config["trainer"].update(devices=devices, strategy="ddp")
        config["data"].update(samples_per_row=4, max_completion_length=8)
    if checkpoint_dir is not None:
        config["trainer"]["enable_checkpointing"] = True
        every_step = {"dirpath": str(checkpoint_dir), "every_n_train_steps": 1, "save_last": True}
        config["trainer"]["callbacks"].append(
            {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": every_step}
        )
    config["data"]["reward_funcs"] = ["preemption_helpers.slow_closeness"]
    path = tmp_path / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def fit_command(config: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "lightning_grpo.cli", "fit", "--config", str(config), *extra]


def start_fit(
    tmp_path: Path, config: Path, *extra: str, reward_sleep: float = 0.0, env: dict[str, str] | None = None
) -> Session:
    """`lightning-grpo fit --config config *extra` in its own session, in `tmp_path`, output to `out<N>.txt`."""
    log = tmp_path / f"out{len(list(tmp_path.glob('out*.txt')))}.txt"
    env = dict(env or os.environ, GRPO_TEST_REWARD_SLEEP=str(reward_sleep))
    return start_session(fit_command(config, *extra), log=log, cwd=tmp_path, env=env, paths=[HERE])


def start_ranks(tmp_path: Path, config: Path, *extra: str, port: int, world_size: int = 2) -> list[Session]:
    """The fit started by hand as `world_size` ranks on this machine (Lightning's `LightningEnvironment`: `LOCAL_RANK`,
    `MASTER_ADDR`, `MASTER_PORT`), each rank a command in its own session, output to `<run>_rank<r>.txt`."""
    sessions = []
    for rank in range(world_size):
        env = dict(os.environ, LOCAL_RANK=str(rank), NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        log = tmp_path / f"{config.stem}_rank{rank}.txt"
        sessions.append(start_session(fit_command(config, *extra), log=log, cwd=tmp_path, env=env, paths=[HERE]))
    return sessions


def rank_zero(out: Path) -> dict:
    """Rank 0's record so far (empty before its first step)."""
    return rank_results(out).get(0, {})
