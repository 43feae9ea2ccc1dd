"""Preemption from the user's side: a real `lightning-grpo fit` gets SIGTERM or SIGUSR1, exits 75 with a checkpoint,
and a resume from it trains every remaining prompt group exactly once."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from preemption_helpers import GROUPS, finish, run_config, start_fit, wait_for


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
        config = run_config(tmp_path, log, slow_step=1, slow_s=4.0)
        process, out = start_fit(tmp_path, config)
        wait_for(lambda: Path(f"{log}.in_step").exists(), process, out, timeout=240)
    else:  # waiting for rollouts: each reward call takes 3 s, a step's generation 6 s
        config = run_config(tmp_path, log)
        process, out = start_fit(tmp_path, config, reward_sleep=3.0)
        wait_for(lambda: log.exists() and log.read_text().strip(), process, out, timeout=240)
    sent = time.monotonic()
    process.send_signal(signum)
    code = finish(process, out)
    exited_s = time.monotonic() - sent
    print(f"{signal.Signals(signum).name} {when}: exited {exited_s:.1f} s after the signal")
    text = out.read_text()
    checkpoint = tmp_path / "preempted.ckpt"
    assert code == 75, text[-3000:]
    assert f"preempted: checkpoint saved to {checkpoint}" in text
    assert "Traceback" not in text, text[-3000:]
    first, summary = _records(log)
    assert summary is None  # the fit did not end normally
    if when == "step":
        assert len(first) == 2, first  # the step in flight (global step 1) finished and was recorded

    resumed_log = tmp_path / "resumed.jsonl"
    config = run_config(tmp_path, resumed_log)
    process, out = start_fit(tmp_path, config, "--ckpt_path", str(checkpoint))
    assert finish(process, out, timeout=240) == 0, out.read_text()[-3000:]
    second, summary = _records(resumed_log)
    trained = [g for step in first + second for g in step]
    assert len(trained) == len(set(trained)), f"a group trained twice: {first} then {second}"
    assert summary["groups_total"] == GROUPS
    assert summary["groups_trained"] == len(trained)
    assert len(trained) + summary["groups_dropped"] == GROUPS
    assert summary["groups_consumed"] == GROUPS


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigterm_while_waiting_for_rollouts_exits_75_and_resume_trains_each_group_once(tmp_path):
    _preempt_and_resume(tmp_path, signal.SIGTERM, when="waiting")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigusr1_during_a_step_finishes_it_exits_75_and_resume_trains_each_group_once(tmp_path):
    _preempt_and_resume(tmp_path, signal.SIGUSR1, when="step")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_slurm_auto_requeue_saves_lightnings_hpc_checkpoint_requeues_and_resumes_by_itself(tmp_path):
    """Under SLURM (faked: its variables, and an `scontrol` that records its arguments), SIGUSR1 saves where
    Lightning's SLURM resume looks, requeues the job, and the requeued command resumes without --ckpt_path."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "scontrol.txt"
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    scontrol.chmod(0o755)
    slurm = dict(
        os.environ,
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        SLURM_NTASKS="1",
        SLURM_JOB_NAME="grpo",
        SLURM_JOB_ID="4242",
        SLURM_PROCID="0",
        SLURM_LOCALID="0",
        SLURM_NODEID="0",
    )
    log = tmp_path / "groups.jsonl"
    process, out = start_fit(tmp_path, run_config(tmp_path, log, slow_step=1, slow_s=4.0), env=slurm)
    wait_for(lambda: Path(f"{log}.in_step").exists(), process, out, timeout=240)
    process.send_signal(signal.SIGUSR1)
    assert finish(process, out) == 75, out.read_text()[-3000:]
    assert f"preempted: checkpoint saved to {tmp_path / 'hpc_ckpt_1.ckpt'}" in out.read_text()
    assert calls.read_text().split() == ["requeue", "4242"]
    first, _ = _records(log)

    resumed_log = tmp_path / "resumed.jsonl"
    process, out = start_fit(tmp_path, run_config(tmp_path, resumed_log), env=slurm)  # the requeued job
    assert finish(process, out, timeout=240) == 0, out.read_text()[-3000:]
    second, summary = _records(resumed_log)
    trained = [g for step in first + second for g in step]
    assert len(trained) == len(set(trained)) and len(trained) + summary["groups_dropped"] == GROUPS
