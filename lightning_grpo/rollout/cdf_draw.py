"""`sampling.draw` at the defaults a GRPO run samples with (a temperature, no top-k, top-p, min-p or repetition
penalty), fused into two passes over each row of logits (`cdf_draw.c`).

torch's way takes the logits to float32, divides them by the temperature, subtracts each row's maximum,
exponentiates, and sums the blocks of the CDF's inversion: five passes over a 49k vocabulary for every row of a
decode step, each writing a vocabulary-sized tensor. The kernel reads the logits (float32 or bf16) twice, once for
the maximum and once to sum each block's softmax numerators, stores nothing of the vocabulary's size, and returns
the same draw: the same division, the same blocks and the same inversion as `draw`, so a token differs from
`draw`'s only where a uniform number falls within float32 rounding of a step of the CDF.

The kernel is C, compiled on first use (`native_build`); where it cannot run (not x86 with AVX2 and FMA, no
compiler, a failed build, or `LIGHTNING_GRPO_CDF_DRAW=0`), `available()` is False, `unavailable_reason()` says why
(logged once), and the generator samples through `sampling`.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path

import torch

from . import native_build

#: Set to "0" to sample through `sampling` instead.
ENV_SWITCH = "LIGHTNING_GRPO_CDF_DRAW"
#: The dtypes of logits the kernel reads.
DTYPES = (torch.float32, torch.bfloat16)

_SOURCE = Path(__file__).with_name("cdf_draw.c")


def available() -> bool:
    """Whether `draw` can run here (the kernel is built and loaded on the first call)."""
    return _load()[0] is not None


def unavailable_reason() -> str | None:
    """Why the kernel cannot run here, or None when it can."""
    return _load()[1]


def draw(logits: torch.Tensor, uniform: torch.Tensor, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row drawn from `softmax(logits / temperature)` by inverting the row's CDF at `uniform`, and its
    log-probability (float32): `sampling.draw(sampling_scores(logits, temperature), uniform)`.

    Args:
        logits: (rows, vocab) float32 or bf16 on CPU, each row contiguous (rows may be strided); not written.
        uniform: (rows,) float32 in [0, 1).
        temperature: > 0.

    Raises:
        RuntimeError: the kernel is not available here (with the reason), or it could not get scratch memory.
        ValueError: tensors of other dtypes or layouts, or a temperature that is not positive.
    """
    kernel, reason = _load()
    if kernel is None:
        raise RuntimeError(f"cdf_draw.draw cannot run here: {reason}")
    rows, vocab = logits.shape
    if logits.dtype not in DTYPES or logits.stride(-1) != 1 or uniform.shape != (rows,) or not temperature > 0:
        raise ValueError(
            f"cdf_draw.draw takes logits (rows, vocab) in {DTYPES} with contiguous rows, uniform (rows,) and a "
            f"temperature > 0; got logits {logits.dtype} {tuple(logits.shape)} strides {tuple(logits.stride())}, "
            f"uniform {tuple(uniform.shape)}, temperature {temperature}. Use sampling.draw."
        )
    uniform = uniform.to(torch.float32).contiguous()
    tokens, logprobs = torch.empty(rows, dtype=torch.long), torch.empty(rows, dtype=torch.float32)
    code = kernel(
        logits.data_ptr(), rows, vocab, logits.stride(0), int(logits.dtype == torch.bfloat16), temperature,
        uniform.data_ptr(), tokens.data_ptr(), logprobs.data_ptr(),
    )  # fmt: skip
    if code != 0:
        raise RuntimeError("cdf_draw.draw could not allocate its scratch memory.")
    return tokens, logprobs


@functools.cache
def _load() -> tuple[Callable[..., int] | None, str | None]:
    """(the kernel's function, None), or (None, why not); the reason is logged once."""
    argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_float]
    return native_build.load_function(
        _SOURCE,
        "cdf_draw",
        [*argtypes, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p],
        switch=ENV_SWITCH,
        kernel="fused sampler",
        fallback="torch's sampling operations",
        wide=True,
    )
