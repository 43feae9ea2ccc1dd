"""Linear layers for the few rows of a decode step: `x @ weight.T (+ bias)` in float32 on x86 CPUs with AVX2 and FMA.

A decode step feeds each linear layer one row per running completion (tens of rows), where a layer's cost is one
pass over its weights. torch's CPU GEMM is built for large batches: at a few dozen rows it spends more time laying
the weights out for its kernel than multiplying. `linear` streams each weight row once instead and takes its dot
product with every row of `x` while both sit in the cache (`small_matmul.c`). Each output element is summed in the
same order whatever the other rows are, so a row's result does not depend on the batch it is in.

The kernel is C, compiled on first use (`native_build`). Where it cannot run (not x86 with AVX2 and FMA, no compiler, the build fails, or
`LIGHTNING_GRPO_SMALL_MATMUL=0`), `available()` is False, `unavailable_reason()` says why (logged once), and callers
use torch's own linear layers.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path

import torch

from . import native_build

#: Most rows of `x` the kernel is used for; a longer batch (a prefill) is torch's.
MAX_ROWS = 64
#: Weights with fewer elements run on one thread: starting threads for the call would cost more than it saves.
#: (A decoder layer's q, o, gate, up and down projections are above it; a grouped-query k or v of a small model is not.)
SPLIT_MIN_NUMEL = 1 << 18
#: Set to "0" to use torch's linear layers instead.
ENV_SWITCH = "LIGHTNING_GRPO_SMALL_MATMUL"

_SOURCE = Path(__file__).with_name("small_matmul.c")


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
    """(the kernel's function, None), or (None, why not); the reason is logged once. The function returns the
    number of threads that could not be started (their share ran on the calling thread)."""
    argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    return native_build.load_function(
        _SOURCE,
        "small_matmul",
        argtypes,
        switch=ENV_SWITCH,
        kernel="small-batch kernel",
        fallback="torch's linear layers",
    )
