"""What the benchmarks share: the offline environment (set on import, before torch or TRL load), the model names,
a line describing the machine and commit, the median of timed runs, and a quiet CPU trainer.

Each benchmark runs as `python benchmarks/<name>.py`, which puts this folder on `sys.path`; import this module
before anything that imports torch, transformers or TRL.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

#: `--model` choices of the benchmarks -> `load_policy` names.
MODELS = {"tiny": "tiny-random", "smollm2": "smollm2-135m-instruct", "gemma3": "gemma-3-270m"}
ROOT = Path(__file__).resolve().parents[1]


def git_commit() -> str:
    """The checkout's short commit, or "?" outside a git checkout."""
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    return done.stdout.strip() or "?"


def machine() -> str:
    """The processor and the CPU count, as the benchmarks' headers print them."""
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"


#: The CPU flags that decide which kernels and precision a run gets (`AutoPrecision`, the packed products).
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


#: The /proc/cpuinfo fields that name a CPU's generation, under the keys `cpu()` records them as.
_CPU_NUMBERS = {"family": "cpu family", "model_number": "model"}


def cpu() -> dict[str, Any]:
    """The processor's model name, its cores, the flags in `CPU_FLAGS` it has and, where Linux's /proc/cpuinfo gives
    them, its family and model numbers: a VM often names every AMD host "AMD EPYC", and the numbers tell the
    generations apart (family 25, model 17 is Zen 4; family 26 is Zen 5). Where the environment caps the instructions
    torch and oneDNN use (`ONEDNN_MAX_CPU_ISA=AVX2`: a newer CPU run as an AVX2-only one), `isa_caps` names the caps:
    the flags then list instructions the run did not use."""
    from lightning_grpo.models.dtype_probe import isa_caps  # here, not at the top: this module loads before torch

    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        info = ""
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    flags = set(fields.get("flags", "").split())
    return {
        "model": fields.get("model name") or platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "flags": [flag for flag in CPU_FLAGS if flag in flags],
        **{name: int(fields[key]) for name, key in _CPU_NUMBERS.items() if fields.get(key, "").isdigit()},
        **({"isa_caps": caps} if (caps := isa_caps()) else {}),
    }


def provenance(command: str) -> dict[str, Any]:
    """What a results page states about a run: the `command` (after the caps on the instructions it ran under, as
    the environment assignments that repeat them), the commit, the machine and the date (UTC)."""
    machine = cpu()
    command = f"{machine['isa_caps']} {command}" if "isa_caps" in machine else command
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, cwd=ROOT
    )
    commit = git_commit() + ("+uncommitted changes" if dirty.stdout.strip() else "")
    return {
        "command": command,
        "commit": commit,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "machine": machine,
    }


def median_seconds(function: Callable[[], Any], warmup: int, reps: int) -> float:
    """The median wall time of `reps` calls of `function`, after `warmup` calls left out."""
    for _ in range(warmup):
        function()
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def hf_generate_left_padded(model: Any, prompts: list[list[int]], new_tokens: int, copies: int = 1) -> None:
    """HF `model.generate` over `prompts` left-padded (pad id 0), sampling at temperature 1 exactly `new_tokens`
    tokens per row (`copies` rows per prompt): the static-batch baseline the generation benchmarks compare with."""
    import torch

    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            num_return_sequences=copies,
            pad_token_id=0,
        )


#: The size of the tensor `memory_bandwidth` reads and copies: well over any cache.
BANDWIDTH_BYTES = 256 * 2**20


def memory_bandwidth(reps: int) -> tuple[float, float]:
    """GB/s of the fastest of `reps` reads (`sum`) and copies (bytes copied; the faster of torch's `copy_` and libc's
    `memmove`, which the shared-memory push uses) of a tensor well over any cache, on this process's threads."""
    import ctypes

    import torch

    source = torch.rand(BANDWIDTH_BYTES // 4)
    target = torch.zeros_like(source)  # written once here, so that no copy below pays its page faults
    copies = (
        lambda: target.copy_(source),
        lambda: ctypes.memmove(target.data_ptr(), source.data_ptr(), BANDWIDTH_BYTES),
    )
    read = copied = float("inf")
    for _ in range(reps):
        started = time.perf_counter()
        source.sum()
        read = min(read, time.perf_counter() - started)
        for copy_once in copies:
            started = time.perf_counter()
            copy_once()
            copied = min(copied, time.perf_counter() - started)
    return BANDWIDTH_BYTES / read / 1e9, BANDWIDTH_BYTES / copied / 1e9


def quiet_cpu_trainer(**overrides: Any) -> Any:
    """A one-process CPU `Trainer` that lets the data module end the run and prints nothing of its own: no
    checkpoints, progress bar, model summary or validation unless `overrides` say so."""
    import lightning.pytorch as pl

    options = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=-1,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    return pl.Trainer(**(options | overrides))
