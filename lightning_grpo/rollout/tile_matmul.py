"""bf16 linear layers on AMX tiles (Intel Xeon from Sapphire Rapids on): `x @ weight.T + bias` for a decode step's
rows, with the weight laid out once for the tiles.

At a decode step's few dozen rows a layer's cost is one read of its weights. `linear` reads them once, front to back,
at about the memory's rate while AMX multiplies (`tile_matmul.c`); oneDNN's packed bf16 products read them more
slowly at these row counts. Each output is a float32 sum rounded to bf16 once, as oneDNN's and torch's bf16 products
do; it is summed in the same order whatever the other rows are, so a row's result does not depend on the batch it is
in (oneDNN's does, at some row counts).

The kernel is C, compiled on first use (`native_build`). Where it cannot run (no AMX tiles with bf16 and AVX-512
BF16, torch not running its AVX-512 code, Linux refusing the tile registers, no compiler, a failed build, or
`LIGHTNING_GRPO_TILE_MATMUL=0`), `available()` is False, `unavailable_reason()` says why (logged once), and the
generator runs oneDNN's packed products instead.

Example::

    if tile_matmul.available() and tile_matmul.takes(weight):
        packed = tile_matmul.pack(weight)  # once, and again after each change of `weight`
        y = tile_matmul.linear(x, packed, bias)  # x @ weight.T + bias
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from . import native_build

log = logging.getLogger(__name__)

#: Set to "0" to run oneDNN's packed products instead.
ENV_SWITCH = "LIGHTNING_GRPO_TILE_MATMUL"
#: A weight's in_features must be a multiple of this (one tile holds 32 of K).
K_BLOCK = 32
#: Weights with fewer elements run on one thread: starting threads for the call would cost more than it saves.
SPLIT_MIN_NUMEL = 1 << 18
#: What the CPU must have (torch's names for them, `torch.cpu.get_capabilities()`).
NEEDED = ("amx_tile", "amx_bf16", "avx512_bf16")

_SOURCE = Path(__file__).with_name("tile_matmul.c")
_KERNEL = "AMX tile kernel"
_FALLBACK = "oneDNN's packed products"


@dataclass(frozen=True, slots=True)
class TileWeight:
    """A weight laid out for `linear` by `pack`: its tiles, its shape, and its bias in float32 (or None)."""

    tiles: torch.Tensor
    out_features: int
    in_features: int
    bias: torch.Tensor | None


def available() -> bool:
    """Whether `linear` can run here (the kernel is built and loaded, and the tiles granted, on the first call)."""
    return _load()[0] is not None


def unavailable_reason() -> str | None:
    """Why the kernel cannot run here, or None when it can."""
    return _load()[1]


def takes(weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether `pack(weight, bias)` takes these tensors: a bf16 (out_features, in_features) CPU weight with
    in_features a multiple of `K_BLOCK`, and a bias of out_features elements or None."""
    return (
        weight.dim() == 2
        and weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and weight.shape[1] % K_BLOCK == 0
        and weight.shape[1] > 0
        and (bias is None or (bias.device.type == "cpu" and bias.shape == (weight.shape[0],)))
    )


def pack(weight: torch.Tensor, bias: torch.Tensor | None = None) -> TileWeight:
    """`weight` (and `bias`) laid out for `linear`. Needs `available()` and `takes(weight, bias)`.

    Raises:
        RuntimeError: the kernel is not available here (with the reason).
        ValueError: a weight `takes` refuses.
    """
    functions = _functions()
    if not takes(weight, bias):
        raise ValueError(
            f"tile_matmul.pack takes a bf16 CPU weight (out_features, in_features) with in_features a multiple of "
            f"{K_BLOCK} and a bias of out_features elements; got weight {tuple(weight.shape)} {weight.dtype} on "
            f"{weight.device}, bias {None if bias is None else tuple(bias.shape)}. Use oneDNN's packed products "
            "(models.packed_matmul)."
        )
    out_features, in_features = weight.shape
    weight = weight.detach().contiguous()
    tiles = torch.empty(-(-out_features // 16), in_features // K_BLOCK, 16, 16, 2, dtype=torch.bfloat16)
    functions["tile_pack"](weight.data_ptr(), tiles.data_ptr(), out_features, in_features)
    bias = None if bias is None else bias.detach().to(torch.float32).contiguous()
    return TileWeight(tiles, out_features, in_features, bias)


def linear(x: torch.Tensor, weight: TileWeight) -> torch.Tensor:
    """`x @ weight.T + bias` for the weight and bias `weight` was packed from, in bf16, on `torch.get_num_threads()`
    threads (one for a weight below `SPLIT_MIN_NUMEL` elements). `x` is a bf16 (rows, in_features) CPU tensor.

    Raises:
        RuntimeError: the kernel is not available here (with the reason).
        ValueError: an `x` of another dtype, shape or device.
    """
    functions = _functions()
    if x.dim() != 2 or x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.shape[1] != weight.in_features:
        raise ValueError(
            f"tile_matmul.linear takes a bf16 CPU x of shape (rows, {weight.in_features}); got {tuple(x.shape)} "
            f"{x.dtype} on {x.device}."
        )
    x = x.contiguous()
    rows = x.shape[0]
    out = torch.empty(rows, weight.out_features, dtype=torch.bfloat16)
    if rows == 0:
        return out
    numel = weight.out_features * weight.in_features
    threads = torch.get_num_threads() if numel >= SPLIT_MIN_NUMEL else 1
    bias = 0 if weight.bias is None else weight.bias.data_ptr()
    functions["tile_linear"](
        x.data_ptr(),
        weight.tiles.data_ptr(),
        bias,
        out.data_ptr(),
        rows,
        weight.out_features,
        weight.in_features,
        threads,
    )
    return out


def _functions() -> dict[str, Callable[..., int]]:
    functions, reason = _load()
    if functions is None:
        raise RuntimeError(f"tile_matmul cannot run here: {reason}")
    return functions


@functools.cache
def _load() -> tuple[dict[str, Callable[..., int]] | None, str | None]:
    """(the kernel's functions, None), or (None, why not); the reason is logged once."""
    reason = native_build.refusal(ENV_SWITCH) or _cpu_refusal()
    if reason is not None:
        log.info("The embedded generator's %s is off (%s); %s run instead.", _KERNEL, reason, _FALLBACK)
        return None, reason
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    functions, reason = native_build.load_functions(
        _SOURCE,
        {
            "tile_permission": [],
            "tile_pack": [pointer, pointer, size, size],
            "tile_linear": [pointer] * 4 + [size] * 3 + [ctypes.c_int],
        },
        switch=ENV_SWITCH,
        kernel=_KERNEL,
        fallback=_FALLBACK,
        extra=native_build.AMX_FLAGS,
    )
    if functions is not None and functions["tile_permission"]() != 0:
        reason = "Linux did not grant this process the AMX tile registers (arch_prctl ARCH_REQ_XCOMP_PERM)"
        log.warning("The embedded generator's %s is off (%s); %s run instead.", _KERNEL, reason, _FALLBACK)
        return None, reason
    return functions, reason


def _cpu_refusal() -> str | None:
    """Why this CPU cannot run the kernel (before building it), or None."""
    capabilities = torch.cpu.get_capabilities()
    missing = [name for name in NEEDED if not capabilities.get(name, False)]
    if missing:
        return f"the CPU has no {', '.join(missing)}"
    if native_build.vector_isa() != "AVX512":
        return f"torch runs its {native_build.vector_isa()} code here, not AVX-512 (ATEN_CPU_CAPABILITY)"
    return None
