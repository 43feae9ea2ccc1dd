"""Preemption from the user's side: a real `lightning-grpo fit` gets SIGTERM or SIGUSR1, exits 75 with a checkpoint,
and a resume from it trains every remaining prompt group exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
GROUPS = 8  # smoke: 8 prompts, 2 groups per optimizer step


def _config(tmp_path: Path, log: Path, *, slow_step: int = -1, slow_s: float = 0.0) -> Path:
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
    config["data"]["reward_funcs"] = ["preemption_helpers.slow_closeness"]
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _start(tmp_path: Path, config: Path, *extra: str, reward_sleep: float = 0.0) -> tuple[subprocess.Popen, Path]:
    out = tmp_path / f"out{len(list(tmp_path.glob('out*.txt')))}.txt"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        PYTHONUNBUFFERED="1",
        GRPO_TEST_REWARD_SLEEP=str(reward_sleep),
    )
    command = [sys.executable, "-m", "lightning_grpo.cli", "fit", "--config", str(config), *extra]
    with out.open("w") as f:
        process = subprocess.Popen(
            command, cwd=tmp_path, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
    return process, out


def _wait_for(condition, process: subprocess.Popen, out: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, f"the fit ended early ({process.returncode}):\n{out.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out waiting:\n{out.read_text()[-3000:]}"
        time.sleep(0.05)


def _finish(process: subprocess.Popen, out: Path, timeout: float = 120) -> int:
    try:
        return process.wait(timeout=timeout)
    finally:
        left = _session(process.pid)
        for p in left:
            p.kill()
        assert not left, f"processes left running after the fit exited: {[p.cmdline() for p in left]}"


def _session(sid: int) -> list[psutil.Process]:
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


def _records(log: Path) -> tuple[list[list[int]], dict | None]:
    steps, summary = [], None
    for line in log.read_text().splitlines():
        record = json.loads(line)
        if "summary" in record:
            summary = record["summary"]
        else:
            steps.append(record["groups"])
    return steps, summary


def _preempt_and_resume(tmp_path: Path, signum: int, *, when: str) -> None:
    log = tmp_path / "groups.jsonl"
    if when == "step":
        config = _config(tmp_path, log, slow_step=1, slow_s=4.0)
        process, out = _start(tmp_path, config)
        _wait_for(lambda: Path(f"{log}.in_step").exists(), process, out, timeout=240)
    else:  # waiting for rollouts: each reward call takes 3 s, a step's generation 6 s
        config = _config(tmp_path, log)
        process, out = _start(tmp_path, config, reward_sleep=3.0)
        _wait_for(lambda: log.exists() and log.read_text().strip(), process, out, timeout=240)
    sent = time.monotonic()
    process.send_signal(signum)
    code = _finish(process, out)
    exited_s = time.monotonic() - sent
    print(f"{signal.Signals(signum).name} {when}: exited {exited_s:.1f} s after the signal")
    text = out.read_text()
    checkpoint = tmp_path / "preempted.ckpt"
    assert code == 75, text[-3000:]
    assert f"preempted: checkpoint saved to {checkpoint}" in text
    assert "Traceback" not in text, text[-3000:]
    # during a step: the rest of the 4 s step, the save and the exit; waiting: no 6 s generation awaited
    assert exited_s < (30 if when == "step" else 20), exited_s
    first, summary = _records(log)
    assert summary is None  # the fit did not end normally
    if when == "step":
        assert len(first) == 2, first  # the step in flight (global step 1) finished and was recorded

    resumed_log = tmp_path / "resumed.jsonl"
    config = _config(tmp_path, resumed_log)
    process, out = _start(tmp_path, config, "--ckpt_path", str(checkpoint))
    assert _finish(process, out, timeout=240) == 0, out.read_text()[-3000:]
    second, summary = _records(resumed_log)
    trained = [g for step in first + second for g in step]
    assert len(trained) == len(set(trained)), f"a group trained twice: {first} then {second}"
    assert summary["groups_total"] == GROUPS
    assert summary["groups_trained"] == len(trained)
    assert len(trained) + summary["groups_dropped"] == GROUPS
    assert summary["groups_consumed"] == GROUPS


@pytest.mark.timeout(600)
def test_sigterm_while_waiting_for_rollouts_exits_75_and_resume_trains_each_group_once(tmp_path):
    _preempt_and_resume(tmp_path, signal.SIGTERM, when="waiting")


@pytest.mark.timeout(600)
def test_sigusr1_during_a_step_finishes_it_exits_75_and_resume_trains_each_group_once(tmp_path):
    _preempt_and_resume(tmp_path, signal.SIGUSR1, when="step")
