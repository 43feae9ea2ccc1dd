"""What the preemption tests put into a real `lightning-grpo fit`: a log of the groups each step trained, a step
that can be made slow, and a slow reward (imported by the trainer and the reward workers through PYTHONPATH)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import psutil
import yaml
from lightning.pytorch.callbacks import Callback

from lightning_grpo.rewards import numeric_closeness


class GroupLog(Callback):
    """Appends `{"step", "groups"}` per trained step (after its optimizer step, fsynced) and, at the end of a fit
    that ended normally, the data module's progress summary.

    Args:
        path: the JSON-lines file.
        slow_step: at this `global_step`, `on_train_batch_start` touches `<path>.in_step` and sleeps `slow_s`, so a
            signal the test sends on seeing that file arrives during the step.
        slow_s: how long that step is held.
    """

    def __init__(self, path: str, slow_step: int = -1, slow_s: float = 0.0) -> None:
        self.path = Path(path)
        self.slow_step = slow_step
        self.slow_s = slow_s

    def _write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.slow_step:
            Path(f"{self.path}.in_step").touch()
            time.sleep(self.slow_s)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._write({"step": trainer.global_step, "groups": list(batch.group_ids)})

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._write({"summary": trainer.datamodule.progress_summary()})


def slow_closeness(completions: list, **kwargs: Any) -> list[float | None]:
    """`numeric_closeness`, after `GRPO_TEST_REWARD_SLEEP` seconds: the trainer spends its time waiting for rollouts."""
    time.sleep(float(os.environ.get("GRPO_TEST_REWARD_SLEEP", "0")))
    return numeric_closeness(completions, **kwargs)


REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
GROUPS = 8  # smoke: 8 prompts, 2 groups per optimizer step


def run_config(
    tmp_path: Path, log: Path, *, slow_step: int = -1, slow_s: float = 0.0, checkpoint_dir: Path | None = None
) -> Path:
    """The smoke config with `GroupLog`, `slow_closeness` and no validation; with `checkpoint_dir`, a checkpoint
    after every step there."""
    config = yaml.safe_load((REPO / "lightning_grpo/configs/smoke.yaml").read_text())
    config["trainer"].update(
        enable_progress_bar=False,
        limit_val_batches=0,
        val_check_interval=None,
        logger=False,
        callbacks=[
            {
                "class_path": "preemption_helpers.GroupLog",
                "init_args": {"path": str(log), "slow_step": slow_step, "slow_s": slow_s},
            }
        ],
    )
    if checkpoint_dir is not None:
        config["trainer"]["enable_checkpointing"] = True
        every_step = {"dirpath": str(checkpoint_dir), "every_n_train_steps": 1, "save_last": True}
        config["trainer"]["callbacks"].append(
            {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": every_step}
        )
    config["data"]["reward_funcs"] = ["preemption_helpers.slow_closeness"]
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def start_fit(
    tmp_path: Path, config: Path, *extra: str, reward_sleep: float = 0.0, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, Path]:
    """`lightning-grpo fit --config config *extra` in its own session, in `tmp_path`, output to `out<N>.txt`."""
    out = tmp_path / f"out{len(list(tmp_path.glob('out*.txt')))}.txt"
    env = dict(
        env or os.environ,
        PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]),  # + helpers
        PYTHONUNBUFFERED="1",
        GRPO_TEST_REWARD_SLEEP=str(reward_sleep),
    )
    command = [sys.executable, "-m", "lightning_grpo.cli", "fit", "--config", str(config), *extra]
    with out.open("w") as f:
        process = subprocess.Popen(
            command,
            cwd=tmp_path,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_as_in_a_terminal,
        )
    return process, out


def _as_in_a_terminal() -> None:
    """Ctrl-C raises KeyboardInterrupt, as in a terminal: a suite started in the background (`cmd &`, nohup, some CI
    runners) has SIGINT ignored, which its children would inherit (and Python keeps an inherited SIG_IGN)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_for(condition, process: subprocess.Popen, out: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, f"the fit ended early ({process.returncode}):\n{out.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out waiting:\n{out.read_text()[-3000:]}"
        time.sleep(0.05)


def finish(process: subprocess.Popen, out: Path, timeout: float = 120) -> int:
    try:
        return process.wait(timeout=timeout)
    finally:
        left = session_processes(process.pid)
        for p in left:
            p.kill()
        assert not left, f"processes left running after the fit exited: {[p.cmdline() for p in left]}"


def session_processes(sid: int) -> list[psutil.Process]:
    """Live processes of the run's session (the rollout child, reward workers, forkserver, ...)."""
    deadline = time.monotonic() + 10
    while True:
        alive = []
        for p in psutil.process_iter():
            try:
                if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except (psutil.Error, ProcessLookupError, PermissionError):
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)
