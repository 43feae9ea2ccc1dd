"""Ctrl-C from the user's side: SIGINT to a real `lightning-grpo fit`'s process group (as a terminal sends it) ends
it with one line naming the last checkpoint, no traceback from the rollout processes, and nothing left running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.fit_script import rank_results
from helpers.processes import Session, finish_sessions, free_port, wait_until
from preemption_helpers import GROUPS, HERE, rank_zero, run_config, start_fit, start_ranks

from lightning_grpo.training.checkpoint_io import read_checkpoint


def _interrupt(sessions: list[Session]) -> tuple[list[int], float]:
    sent = time.monotonic()
    for session in sessions:  # each whole foreground group: trainer, forkserver, rollout child, workers
        session.signal_group(signal.SIGINT)
    codes = finish_sessions(sessions, timeout=120)
    return codes, time.monotonic() - sent


def _interrupted_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("interrupted:")]


@pytest.mark.timeout(300)
def test_ctrl_c_while_the_rollout_child_starts_prints_one_line_and_no_child_traceback(tmp_path):
    fit = start_fit(tmp_path, run_config(tmp_path, tmp_path / "run"))
    wait_until(lambda: "Total params" in fit.log.read_text(), [fit], timeout=240, what="the fit's start")
    time.sleep(1.0)  # the fit, and its child, start
    (code,), exited_s = _interrupt([fit])
    print(f"Ctrl-C at start-up: exited {exited_s:.1f} s later")
    text = fit.log.read_text()
    assert code == 1, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert _interrupted_lines(text) == [
        "interrupted: no checkpoint was saved in this run (SIGTERM instead of Ctrl-C saves one at the next step)"
    ]


@pytest.mark.timeout(300)
def test_ctrl_c_during_training_names_the_last_checkpoint(tmp_path):
    checkpoints = tmp_path / "ckpts"
    config = run_config(tmp_path, tmp_path / "run", checkpoint_dir=checkpoints)
    fit = start_fit(tmp_path, config, reward_sleep=1.0)
    wait_until((checkpoints / "last.ckpt").exists, [fit], timeout=240, what="the first checkpoint")
    (code,), exited_s = _interrupt([fit])
    print(f"Ctrl-C during training: exited {exited_s:.1f} s later")
    text = fit.log.read_text()
    assert code == 1 and "Traceback" not in text, text[-3000:]
    (line,) = _interrupted_lines(text)
    path = line.split("the last checkpoint is ")[1].split(" ")[0]
    assert Path(path).parent == checkpoints and Path(path).is_file(), line


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ctrl_c_to_both_ranks_of_a_ddp_fit_exits_1_on_both_naming_the_checkpoint_and_resume_trains_each_group_once(
    tmp_path,
):
    """Both ranks of a 2-rank DDP fit started by hand (each its own process) hold step 1 when Ctrl-C reaches each
    rank's process group: both exit 1 with no traceback, rank 0 names the last checkpoint (step 1, written by the
    every-step checkpointing; Ctrl-C writes none), nothing of either rank is left, and the resume from it trains every
    other group once."""
    run, checkpoints = tmp_path / "run", tmp_path / "ckpts"
    config = run_config(tmp_path, run, devices=2, hold_step=1, hold_s=5.0, checkpoint_dir=checkpoints)
    ranks = start_ranks(tmp_path, config, port=free_port())
    held = [run / "in_step0", run / "in_step1"]
    wait_until(lambda: all(p.exists() for p in held), ranks, timeout=400, what="both ranks in step 1")
    codes, exited_s = _interrupt(ranks)
    print(f"Ctrl-C to both ranks: exited {exited_s:.1f} s later")
    logs = [rank.log.read_text() for rank in ranks]
    assert codes == [1, 1], "\n".join(log[-2500:] for log in logs)
    assert not any("Traceback" in log for log in logs), "\n".join(log[-2500:] for log in logs)
    (line,) = _interrupted_lines(logs[0])
    checkpoint = Path(line.split("the last checkpoint is ")[1].split(" ")[0])
    assert checkpoint.parent == checkpoints and read_checkpoint(checkpoint)["global_step"] == 1, line
    first = rank_results(run)
    for rank in (0, 1):
        assert first[rank]["error"].startswith("KeyboardInterrupt"), first[rank]
        assert first[rank]["global_step"] == 1 and first[rank]["steps"] == first[0]["steps"]

    resumed = tmp_path / "resumed"
    ranks = start_ranks(
        tmp_path, run_config(tmp_path, resumed, devices=2), "--ckpt_path", str(checkpoint), port=free_port()
    )
    assert finish_sessions(ranks, timeout=400) == [0, 0], "\n".join(rank.output() for rank in ranks)
    second = rank_zero(resumed)
    trained = [g for step in first[0]["steps"] + second["steps"] for g in step]
    assert len(trained) == len(set(trained)), (first[0]["steps"], second["steps"])
    assert second["consumed"] == list(range(GROUPS))
    assert len(trained) + second["summary"]["groups_dropped"] == GROUPS, second["summary"]


_START_STOP = """
from datasets import Dataset
from lightning_grpo.models import char_tokenizer
from lightning_grpo.rollout.worker import GRPORolloutWorker

def reward(completions, **kwargs):
    return [float(len(str(c))) for c in completions]

if __name__ == "__main__":
    tok = char_tokenizer()
    worker = GRPORolloutWorker(
        model_name="tiny-random", generator="embedded", dataset=Dataset.from_dict({"prompt": ["1+1=", "2+2="]}),
        reward_funcs=[reward], processing_class=tok, eos_token_ids=[tok.eos_token_id], num_generations=2,
        max_tokens=4, child_ready_timeout=120,
    )
    worker.start()
    worker.rollout_buffer.get(timeout=120)
    worker.stop()
    print("stopped", flush=True)
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_worker_stop_leaves_no_semaphore_for_the_resource_tracker(tmp_path, start_method):
    script = tmp_path / "start_stop.py"
    script.write_text(_START_STOP)
    env = dict(os.environ, LIGHTNING_GRPO_START_METHOD=start_method, PYTHONPATH=str(HERE))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, env=env)
    assert result.returncode == 0 and "stopped" in result.stdout, result.stderr[-3000:]
    assert "leaked semaphore" not in result.stderr and "resource_tracker" not in result.stderr, result.stderr
