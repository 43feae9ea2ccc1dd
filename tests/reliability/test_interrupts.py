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
from preemption_helpers import HERE, finish, run_config, start_fit, wait_for


def _interrupt(process: subprocess.Popen, out: Path) -> tuple[int, str, float]:
    sent = time.monotonic()
    os.killpg(process.pid, signal.SIGINT)  # the whole foreground group: trainer, forkserver, rollout child, workers
    code = finish(process, out)
    return code, out.read_text(), time.monotonic() - sent


@pytest.mark.timeout(300)
def test_ctrl_c_while_the_rollout_child_starts_prints_one_line_and_no_child_traceback(tmp_path):
    log = tmp_path / "groups.jsonl"
    process, out = start_fit(tmp_path, run_config(tmp_path, log))
    wait_for(lambda: "Total params" in out.read_text(), process, out, timeout=240)  # the fit, and its child, start
    time.sleep(1.0)
    code, text, exited_s = _interrupt(process, out)
    print(f"Ctrl-C at start-up: exited {exited_s:.1f} s later")
    assert code == 1, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    lines = [line for line in text.splitlines() if line.startswith("interrupted:")]
    assert lines == [
        "interrupted: no checkpoint was saved in this run (SIGTERM instead of Ctrl-C saves one at the next step)"
    ]


@pytest.mark.timeout(300)
def test_ctrl_c_during_training_names_the_last_checkpoint(tmp_path):
    log, checkpoints = tmp_path / "groups.jsonl", tmp_path / "ckpts"
    process, out = start_fit(tmp_path, run_config(tmp_path, log, checkpoint_dir=checkpoints), reward_sleep=1.0)
    wait_for(lambda: (checkpoints / "last.ckpt").exists(), process, out, timeout=240)
    code, text, exited_s = _interrupt(process, out)
    print(f"Ctrl-C during training: exited {exited_s:.1f} s later")
    assert code == 1 and "Traceback" not in text, text[-3000:]
    (line,) = [line for line in text.splitlines() if line.startswith("interrupted:")]
    path = line.split("the last checkpoint is ")[1].split(" ")[0]
    assert Path(path).parent == checkpoints and Path(path).is_file(), line


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
