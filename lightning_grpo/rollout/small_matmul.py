"""Linear layers for the few rows of a decode step: `x @ weight.T (+ bias)` in float32 on x86 CPUs with AVX2 and FMA.

A decode step feeds each linear layer one row per running completion (tens of rows), where a layer's cost is one
pass over its weights. torch's CPU GEMM is built for large batches: at a few dozen rows it spends more time laying
the weights out for its kernel than multiplying. `linear` streams each weight row once instead and takes its dot
product with every row of `x` while both sit in the cache (`small_matmul.c`). Each output element is summed in the
same order whatever the other rows are, so a row's result does not depend on the batch it is in.

The kernel is C, compiled on first use with the system's C compiler (`$CC`, else `cc`) into
`<cache>/kernels/` (`$LIGHTNING_GRPO_CACHE`, default `~/.cache/lightning_grpo`), once per source and compiler; a
build takes about a second. Where it cannot run (not x86 with AVX2 and FMA, no compiler, the build fails, or
`LIGHTNING_GRPO_SMALL_MATMUL=0`), `available()` is False, `unavailable_reason()` says why (logged once), and callers
use torch's own linear layers.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

#: Most rows of `x` the kernel is used for; a longer batch (a prefill) is torch's.
MAX_ROWS = 64
#: Weights with fewer elements run on one thread: starting threads for the call would cost more than it saves.
#: (A decoder layer's q, o, gate, up and down projections are above it; a grouped-query k or v of a small model is not.)
SPLIT_MIN_NUMEL = 1 << 18
#: Set to "0" to use torch's linear layers instead.
ENV_SWITCH = "LIGHTNING_GRPO_SMALL_MATMUL"

_SOURCE = Path(__file__).with_name("small_matmul.c")
_FLAGS = ("-O3", "-mavx2", "-mfma", "-shared", "-fPIC", "-pthread")


def available() -> bool:
    """Whether `linear` can run here (the kernel is built and loaded on the first call)."""
    return _load()[0] is not None


def unavailable_reason() -> str | None:
    """Why the kernel cannot run here, or None when it can."""
    return _load()[1]


def applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether `linear(x, weight, bias)` takes these tensors: float32, contiguous, x of shape (rows <= `MAX_ROWS`,
    in_features) and weight (out_features, in_features), on CPU."""
    return (
        x.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS
        and weight.dim() == 2
        and x.shape[1] == weight.shape[1]
        and x.dtype == weight.dtype == torch.float32
        and x.device.type == weight.device.type == "cpu"
        and x.is_contiguous()
        and weight.is_contiguous()
        and (bias is None or (bias.dtype == torch.float32 and bias.shape == (weight.shape[0],)))
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`torch.nn.functional.linear(x, weight, bias)` through the kernel, on `torch.get_num_threads()` threads (one
    thread for a weight below `SPLIT_MIN_NUMEL` elements). Needs `available()` and `applies(x, weight, bias)`.

    Raises:
        RuntimeError: the kernel is not available here (with the reason).
        ValueError: tensors `applies` refuses.
    """
    kernel, reason = _load()
    if kernel is None:
        raise RuntimeError(f"small_matmul.linear cannot run here: {reason}")
    if not applies(x, weight, bias):
        raise ValueError(
            f"small_matmul.linear takes contiguous float32 CPU tensors, x (rows <= {MAX_ROWS}, in_features) and "
            f"weight (out_features, in_features); got x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} "
            f"{weight.dtype}. Use torch.nn.functional.linear."
        )
    rows, columns = x.shape[0], weight.shape[0]
    out = torch.empty(rows, columns, dtype=torch.float32)
    threads = torch.get_num_threads() if weight.numel() >= SPLIT_MIN_NUMEL else 1
    kernel(x.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, columns, x.shape[1], threads)
    return out if bias is None else out.add_(bias)


@functools.cache
def _load() -> tuple[Callable[..., int] | None, str | None]:
    """(the kernel's function, None), or (None, why not); the reason is logged once."""
    reason = _refusal()
    if reason is not None:
        log.info("The embedded generator's small-batch kernel is off (%s); torch's linear layers run instead.", reason)
        return None, reason
    try:
        library = ctypes.CDLL(str(_build()))
    except (OSError, subprocess.SubprocessError) as error:
        reason = f"building or loading {_SOURCE.name} failed: {error}"
        log.warning("The embedded generator's small-batch kernel is off (%s); torch's linear layers run.", reason)
        return None, reason
    function = library.small_matmul
    function.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    function.restype = ctypes.c_int  # threads that could not be started (their share ran on the calling thread)
    return function, None


def _refusal() -> str | None:
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return f"{ENV_SWITCH}=0"
    if platform.machine().lower() not in {"x86_64", "amd64"}:
        return f"the CPU is {platform.machine()}, not x86-64"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in {"AVX2", "AVX512"}:  # torch's AVX2 level requires FMA too
        return f"the CPU has no AVX2 and FMA (torch reports {capability})"
    if _compiler() is None:
        return "no C compiler found: set $CC or install gcc"
    return None


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc")


def _build() -> Path:
    """The shared library, compiled into the cache folder unless a build of the same source and compiler is there.

    Concurrent builds (several processes starting at once) each write their own file and rename it into place.
    """
    from ..models.smollm2 import default_cache_dir

    compiler = _compiler()
    if compiler is None:
        raise OSError("no C compiler found: set $CC or install gcc")
    source = _SOURCE.read_bytes()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    digest = hashlib.sha256(b"\0".join([source, " ".join(_FLAGS).encode(), version.encode()])).hexdigest()[:16]
    folder = default_cache_dir() / "kernels"
    target = folder / f"small_matmul-{digest}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(dir=folder, prefix=".small_matmul-", suffix=".so")
    os.close(handle)
    try:
        done = subprocess.run(
            [compiler, *_FLAGS, str(_SOURCE), "-o", partial], capture_output=True, text=True, timeout=120
        )
        if done.returncode != 0:
            raise OSError(f"{compiler} exited {done.returncode}: {done.stderr.strip()[-500:]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target
