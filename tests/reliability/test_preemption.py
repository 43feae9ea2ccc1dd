"""Preemption from the user's side: a real `lightning-grpo fit` gets SIGTERM or SIGUSR1, exits 75 with a checkpoint,
and a resume from it trains every remaining prompt group exactly once; on one process, and on two DDP ranks (gloo)
started by hand, each rank its own process, with SIGTERM to every rank or to rank 0 only (the other learns it from
the ranks' shared decision)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from helpers.fit_script import rank_results
from helpers.processes import finish_sessions, free_port, wait_until
from preemption_helpers import GROUPS, rank_zero, run_config, start_fit, start_ranks

from lightning_grpo.training.checkpoint_io import read_checkpoint


def _trained(record: dict, up_to: int | None = None) -> list[int]:
    return [g for step in record["steps"][:up_to] for g in step]


def _check_resume_trains_each_group_once(first: dict, resumed: dict) -> None:
    """Over both runs every group was consumed once: trained in one or the other (never twice), or dropped."""
    trained = _trained(first) + _trained(resumed)
    summary = resumed["summary"]
    assert len(trained) == len(set(trained)), f"a group trained twice: {first['steps']} then {resumed['steps']}"
    assert summary["groups_total"] == summary["groups_consumed"] == GROUPS, summary
    assert summary["groups_trained"] == len(trained), (summary, trained)
    assert len(trained) + summary["groups_dropped"] == GROUPS, summary
    assert resumed["consumed"] == list(range(GROUPS))


def _preempt_and_resume(tmp_path: Path, signum: int, *, when: str) -> None:
    run = tmp_path / "run"
    if when == "step":
        fit = start_fit(tmp_path, run_config(tmp_path, run, hold_step=1, hold_s=4.0))
        wait_until((run / "in_step0").exists, [fit], timeout=240, what="the held step")
    else:  # waiting for rollouts: each reward call takes 3 s, a step's generation 6 s
        fit = start_fit(tmp_path, run_config(tmp_path, run), reward_sleep=3.0)
        wait_until(lambda: rank_zero(run).get("steps"), [fit], timeout=240, what="the first step")
    sent = time.monotonic()
    fit.process.send_signal(signum)
    (code,) = finish_sessions([fit], timeout=120)
    print(f"{signal.Signals(signum).name} {when}: exited {time.monotonic() - sent:.1f} s after the signal")
    text = fit.log.read_text()
    checkpoint = tmp_path / "preempted.ckpt"
    assert code == 75, text[-3000:]
    assert f"preempted: checkpoint saved to {checkpoint}" in text
    assert "Traceback" not in text, text[-3000:]
    first = rank_zero(run)
    assert not first["ended"] and first["error"].startswith("SIGTERMException")  # the fit did not end normally
    assert read_checkpoint(checkpoint)["global_step"] == first["global_step"] == len(first["steps"])
    if when == "step":
        assert len(first["steps"]) == 2, first  # the step in flight (global step 1) finished and was recorded

    resumed = tmp_path / "resumed"
    fit = start_fit(tmp_path, run_config(tmp_path, resumed), "--ckpt_path", str(checkpoint))
    assert finish_sessions([fit], timeout=240) == [0], fit.output()
    _check_resume_trains_each_group_once(first, rank_zero(resumed))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigterm_while_waiting_for_rollouts_exits_75_and_resume_trains_each_group_once(tmp_path):
    _preempt_and_resume(tmp_path, signal.SIGTERM, when="waiting")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigusr1_during_a_step_finishes_it_exits_75_and_resume_trains_each_group_once(tmp_path):
    _preempt_and_resume(tmp_path, signal.SIGUSR1, when="step")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("receivers", ["every_rank", "rank_0_only"])
def test_sigterm_to_a_two_rank_ddp_fit_checkpoints_one_step_exits_75_on_both_and_resume_trains_each_group_once(
    tmp_path, receivers
):
    """Both ranks hold step 1 (global step 1 begins) while the test sends SIGTERM: to each rank's whole process group
    (as `scancel` signals every task), or to rank 0's process only. Both ranks finish the step, agree to stop, save
    the same checkpoint (global step 2) and exit 75; nothing of either rank is left; the resume, again on two ranks,
    trains every other group, none twice."""
    run = tmp_path / "run"
    ranks = start_ranks(tmp_path, run_config(tmp_path, run, devices=2, hold_step=1, hold_s=5.0), port=free_port())
    held = [run / "in_step0", run / "in_step1"]
    wait_until(lambda: all(p.exists() for p in held), ranks, timeout=400, what="both ranks in step 1")
    if receivers == "every_rank":
        for rank in ranks:
            rank.signal_group(signal.SIGTERM)
    else:
        os.kill(ranks[0].pid, signal.SIGTERM)
    codes = finish_sessions(ranks, timeout=180)
    logs = [rank.log.read_text() for rank in ranks]
    assert codes == [75, 75], "\n".join(log[-2500:] for log in logs)
    checkpoint = tmp_path / "preempted.ckpt"
    assert f"preempted: checkpoint saved to {checkpoint}" in logs[0], logs[0][-3000:]
    assert not any("Traceback" in log for log in logs), "\n".join(log[-2500:] for log in logs)
    first = rank_results(run)
    assert set(first) == {0, 1}
    for rank in (0, 1):
        assert first[rank]["error"].startswith("SIGTERMException"), first[rank]
    assert first[0]["global_step"] == first[1]["global_step"] == 2  # the held step finished on both
    assert first[0]["steps"] == first[1]["steps"] and first[0]["weights"] == first[1]["weights"]
    assert read_checkpoint(checkpoint)["global_step"] == 2

    resumed = tmp_path / "resumed"
    config = run_config(tmp_path, resumed, devices=2)
    ranks = start_ranks(tmp_path, config, "--ckpt_path", str(checkpoint), port=free_port())
    assert finish_sessions(ranks, timeout=400) == [0, 0], "\n".join(rank.output() for rank in ranks)
    second = rank_results(resumed)
    assert second[0]["ended"] and second[1]["ended"] and second[0]["weights"] == second[1]["weights"]
    _check_resume_trains_each_group_once(first[0], second[0])


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
    run = tmp_path / "run"
    fit = start_fit(tmp_path, run_config(tmp_path, run, hold_step=1, hold_s=4.0), env=slurm)
    wait_until((run / "in_step0").exists, [fit], timeout=240, what="the held step")
    fit.process.send_signal(signal.SIGUSR1)
    assert finish_sessions([fit], timeout=120) == [75], fit.output()
    assert f"preempted: checkpoint saved to {tmp_path / 'hpc_ckpt_1.ckpt'}" in fit.log.read_text()
    assert calls.read_text().split() == ["requeue", "4242"]
    first = rank_zero(run)

    resumed = tmp_path / "resumed"
    fit = start_fit(tmp_path, run_config(tmp_path, resumed), env=slurm)  # the requeued job
    assert finish_sessions([fit], timeout=240) == [0], fit.output()
    _check_resume_trains_each_group_once(first, rank_zero(resumed))
