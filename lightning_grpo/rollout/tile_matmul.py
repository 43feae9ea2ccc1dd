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

int8 weights (`pack(weight, int8=True)`, where the CPU also has amx_int8: `int8_available()`): the weight is rounded
to int8 with a float32 scale per output feature (`quantize`), which halves the bytes a step reads. x stays about
16 bits: each row is split into two int8 rows (`tile_matmul.c`), and the int32 sums are combined with the scales in
float32 and rounded to bf16 once. The outputs then differ from the bf16 weight's by the weight's rounding (up to half
a step of max |w_row| / 127 per element), not by the activations'.

Example::

    if tile_matmul.available() and tile_matmul.takes(weight):
        packed = tile_matmul.pack(weight, bias)  # once, and again after each change of `weight`
        y = tile_matmul.linear(x, packed)  # x @ weight.T + bias
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
#: An int8 weight's in_features must be a multiple of this (one int8 tile holds 64 of K).
K_BLOCK_INT8 = 64
#: What the CPU must have (torch's names for them, `torch.cpu.get_capabilities()`).
NEEDED = ("amx_tile", "amx_bf16", "avx512_bf16")
#: What int8 weights need besides.
NEEDED_INT8 = ("amx_int8",)

_SOURCE = Path(__file__).with_name("tile_matmul.c")
_KERNEL = "AMX tile kernel"
_FALLBACK = "oneDNN's packed products"


@dataclass(frozen=True, slots=True)
class TileWeight:
    """A weight laid out for `linear` by `pack`: its tiles, its shape, its bias in float32 (or None), and for int8
    tiles the float32 scale of each output feature (else None)."""

    tiles: torch.Tensor
    out_features: int
    in_features: int
    bias: torch.Tensor | None
    scale: torch.Tensor | None = None


def available() -> bool:
    """Whether `linear` can run here (the kernel is built and loaded, and the tiles granted, on the first call)."""
    return _load()[0] is not None


def unavailable_reason() -> str | None:
    """Why the kernel cannot run here, or None when it can."""
    return _load()[1]


def int8_available() -> bool:
    """Whether `linear` can run int8 weights here: `available()`, and the CPU has `NEEDED_INT8`."""
    capabilities = torch.cpu.get_capabilities()
    return available() and all(capabilities.get(name, False) for name in NEEDED_INT8)


def takes(weight: torch.Tensor, bias: torch.Tensor | None = None, int8: bool = False) -> bool:
    """Whether `pack(weight, bias, int8)` takes these tensors: a bf16 (out_features, in_features) CPU weight with
    in_features a multiple of `K_BLOCK` (`K_BLOCK_INT8` for int8), and a bias of out_features elements or None."""
    return (
        weight.dim() == 2
        and weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and weight.shape[1] % (K_BLOCK_INT8 if int8 else K_BLOCK) == 0
        and weight.shape[1] > 0
        and (bias is None or (bias.device.type == "cpu" and bias.shape == (weight.shape[0],)))
    )


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A bf16 `weight` (out_features, in_features) rounded to int8 per output feature: (q, scale) with
    `q * scale[:, None]` nearest to `weight` on the grid of step `scale = max |w_row| / 127` (symmetric, round half to
    even; a row of zeros has scale 0). in_features must be a multiple of 16.

    Raises:
        RuntimeError: the kernel is not available here (with the reason).
    """
    functions = _functions()
    weight = weight.detach().contiguous()
    q = torch.empty(weight.shape, dtype=torch.int8)
    scale = torch.empty(weight.shape[0], dtype=torch.float32)
    functions["tile_quantize"](weight.data_ptr(), q.data_ptr(), scale.data_ptr(), *weight.shape)
    return q, scale


def pack(weight: torch.Tensor, bias: torch.Tensor | None = None, int8: bool = False) -> TileWeight:
    """`weight` (and `bias`) laid out for `linear`: as bf16 tiles, or with `int8` rounded to int8 (`quantize`) and laid
    out as int8 tiles. Needs `available()` (and `int8_available()` for int8) and `takes(weight, bias, int8)`.

    Raises:
        RuntimeError: the kernel (or its int8 products) is not available here (with the reason).
        ValueError: a weight `takes` refuses.
    """
    functions = _functions()
    if int8 and not int8_available():
        raise RuntimeError(f"tile_matmul cannot run int8 weights here: the CPU has no {', '.join(NEEDED_INT8)}.")
    if not takes(weight, bias, int8):
        raise ValueError(
            f"tile_matmul.pack takes a bf16 CPU weight (out_features, in_features) with in_features a multiple of "
            f"{K_BLOCK_INT8 if int8 else K_BLOCK} and a bias of out_features elements; got weight "
            f"{tuple(weight.shape)} {weight.dtype} on {weight.device}, bias {None if bias is None else tuple(bias.shape)}"
            f"{' with int8=True' if int8 else ''}. Use oneDNN's packed products (models.packed_matmul)."
        )
    out_features, in_features = weight.shape
    blocks = -(-out_features // 16)
    bias = None if bias is None else bias.detach().to(torch.float32).contiguous()
    if not int8:
        tiles = torch.empty(blocks, in_features // K_BLOCK, 16, 16, 2, dtype=torch.bfloat16)
        functions["tile_pack"](weight.detach().contiguous().data_ptr(), tiles.data_ptr(), out_features, in_features)
        return TileWeight(tiles, out_features, in_features, bias)
    q, scale = quantize(weight)
    tiles = torch.empty(blocks, in_features // K_BLOCK_INT8, 16, 16, 4, dtype=torch.int8)
    # four int8 of K take the place of two bf16: the same layout, at half the K
    functions["tile_pack"](q.data_ptr(), tiles.data_ptr(), out_features, in_features // 2)
    return TileWeight(tiles, out_features, in_features, bias, scale)


def linear(x: torch.Tensor, weight: TileWeight) -> torch.Tensor:
    """`x @ weight.T + bias` for the weight and bias `weight` was packed from (for int8 tiles, the rounded weight
    `q * scale`), in bf16, on `torch.get_num_threads()` threads (one for a weight below `SPLIT_MIN_NUMEL` elements).
    `x` is a bf16 (rows, in_features) CPU tensor.

    Raises:
        RuntimeError: the kernel is not available here (with the reason), or could not allocate its buffers.
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
    shape = (rows, weight.out_features, weight.in_features, threads)
    if weight.scale is None:
        functions["tile_linear"](x.data_ptr(), weight.tiles.data_ptr(), bias, out.data_ptr(), *shape)
        return out
    scale = weight.scale.data_ptr()
    if functions["tile_linear_int8"](x.data_ptr(), weight.tiles.data_ptr(), scale, bias, out.data_ptr(), *shape) < 0:
        raise RuntimeError(f"tile_matmul.linear could not allocate the split rows of x {tuple(x.shape)}.")
    return out


def c_functions() -> dict[str, int]:
    """The addresses of `tile_linear` and `tile_linear_int8` in C, for a caller in C (`fused_decode`); empty where
    the kernel cannot run."""
    functions = _load()[0] or {}
    wanted = ("tile_linear", "tile_linear_int8")
    return {name: native_build.address(function) for name, function in functions.items() if name in wanted}


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
            "tile_linear_int8": [pointer] * 5 + [size] * 3 + [ctypes.c_int],
            "tile_quantize": [pointer] * 3 + [size] * 2,
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
