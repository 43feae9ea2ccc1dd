"""Two of the small operations between a decode step's products, each fused into one pass (`layer_ops.c`): Llama's
RMS norm and the rotation of queries and keys by half their head dim (`apply_rotary_pos_emb`).

Between its products, a decode layer runs about thirty of torch's elementwise operations on a few dozen rows, and
each costs more to dispatch than to compute. A fused operation computes in float32 and rounds to the tensors' dtype
wherever torch's sequence of operations would, so it differs from torch's only where a float32 sum is added up in
another order (a bf16 ulp, rarely).

The decoder fuses a model's module or function only where the fused operation matches it on a probe (`norm_for`,
`rotation_for`), so a family whose norm differs (Gemma's `1 + weight`, a bias) or whose rotation
covers part of the head keeps its own. The kernel is C, compiled on first use (`native_build`); where it cannot run
(not x86 with AVX2 and FMA, no compiler, a failed build, or `LIGHTNING_GRPO_LAYER_OPS=0`) nothing is fused and
`unavailable_reason()` says why (logged once).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from . import native_build

#: Set to "0" to run the models' own operations instead.
ENV_SWITCH = "LIGHTNING_GRPO_LAYER_OPS"
#: The dtypes the kernels take.
DTYPES = (torch.float32, torch.bfloat16)
#: How near (relative and absolute) a fused operation must come to the model's own on the probe: two bf16 ulps, or
#: float32 sums added in another order; a different formula misses by far more.
PROBE_TOLERANCE = {torch.bfloat16: 2**-7, torch.float32: 1e-5}
#: Rows of the probes.
_PROBE_ROWS = 5

_SOURCE = Path(__file__).with_name("layer_ops.c")
_POINTER, _INT, _FLOAT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "rms_norm": [_POINTER, _INT, _POINTER, _POINTER, _INT, _INT, _FLOAT, ctypes.c_int],
    "rotate": [_POINTER, _INT, _POINTER, _INT, _POINTER, _POINTER, _POINTER, _POINTER, *[_INT] * 4, ctypes.c_int],
}

Rotation = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def available() -> bool:
    """Whether the fused operations can run here (the kernel is built and loaded on the first call)."""
    return _load()[0] is not None


def unavailable_reason() -> str | None:
    """Why the kernel cannot run here, or None when it can."""
    return _load()[1]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm, `weight * (x / sqrt(mean(x**2) + eps)).to(x.dtype)`, of x (rows, width) (rows may be
    strided) with weight (width,), both float32 or bf16; a new contiguous tensor."""
    _check_rows("rms_norm", x, weight)
    rows, width = x.shape
    out = torch.empty(rows, width, dtype=x.dtype)
    _call("rms_norm", x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), rows, width, eps, _bf16(x))
    return out


def rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)` of Llama: q (rows, heads, dim) and k (rows, kv_heads,
    dim) rotated by their row of cos and sin (rows, dim), as new contiguous tensors (rows of q and k may be strided;
    their heads are contiguous)."""
    _check_rows("rotate", q, k, cos, sin)
    rows, heads, dim = q.shape
    if k.shape[::2] != q.shape[::2] or cos.shape != (rows, dim) or sin.shape != cos.shape:
        raise ValueError(
            f"layer_ops.rotate takes q (rows, heads, dim), k (rows, kv_heads, dim), cos and sin (rows, dim); got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(cos.shape)}, {tuple(sin.shape)}."
        )
    q_out, k_out = torch.empty(q.shape, dtype=q.dtype), torch.empty(k.shape, dtype=k.dtype)
    _call(
        "rotate", q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), cos.data_ptr(), sin.data_ptr(),
        q_out.data_ptr(), k_out.data_ptr(), rows, heads, k.shape[1], dim, _bf16(q),
    )  # fmt: skip
    return q_out, k_out


@dataclass(frozen=True, slots=True)
class FusedNorm:
    """A norm module run as `rms_norm` with its `weight` (read at each call, so weights copied in later are used)
    and its epsilon."""

    module: torch.nn.Module
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.module.weight, self.eps)


def norm_for(module: Callable[[torch.Tensor], torch.Tensor], width: int, dtype: torch.dtype) -> FusedNorm | None:
    """A fused stand-in for the norm `module` over `width` features in `dtype`, where `rms_norm` with the module's
    weight and epsilon matches the module on a probe; else None."""
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if not isinstance(weight, torch.Tensor) or weight.shape != (width,) or not isinstance(eps, float):
        return None
    fused = FusedNorm(module, eps)
    return fused if _matches(fused, module, [_probe(dtype, _PROBE_ROWS, width)]) else None


def rotation_for(
    rope: Callable, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int, head_dim: int
) -> Rotation | None:
    """`rotate` where it matches the model's `rope` (its `apply_rotary_pos_emb`, called with `unsqueeze_dim=1`) on a
    probe rotated by `cos` and `sin` (rows, rotated dims), from the model's rotary embedding; else None (among
    others where the rotation covers part of each head)."""
    rows, dim = cos.shape
    if dim != head_dim or dim % 2 or sin.shape != cos.shape:
        return None
    q, k = _probe(cos.dtype, rows, heads, dim), _probe(cos.dtype, rows, kv_heads, dim)

    def model_rotation(*tensors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope(*tensors, unsqueeze_dim=1)

    return rotate if _matches(rotate, model_rotation, [q, k, cos, sin], pairs=True) else None


def c_functions() -> dict[str, int]:
    """The addresses of `rms_norm` and `rotate` in C, for a caller in C (`fused_decode`); empty where they cannot
    run."""
    functions = _load()[0] or {}
    return {name: native_build.address(function) for name, function in functions.items()}


def _matches(fused: Callable, model: Callable, probes: list[torch.Tensor], pairs: bool = False) -> bool:
    """Whether `fused` runs here and gives what `model` gives on `probes`, within `PROBE_TOLERANCE`."""
    dtype = probes[0].dtype
    if not available() or dtype not in DTYPES:
        return False
    with torch.inference_mode():
        want, got = model(*probes), fused(*probes)
    want, got = (want, got) if pairs else ((want,), (got,))
    tolerance = PROBE_TOLERANCE[dtype]
    return all(
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.allclose(a.float(), b.float(), rtol=tolerance, atol=tolerance)
        for a, b in zip(want, got, strict=True)
    )


def _probe(dtype: torch.dtype, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))).to(dtype)


def _check_rows(operation: str, *tensors: torch.Tensor) -> None:
    """Refuse what the kernels cannot read: mixed or other dtypes, a strided last dimension, strided heads, a strided
    cos or sin (a plain loop: this runs several times a layer)."""
    dtype = tensors[0].dtype
    for index, t in enumerate(tensors):
        if t.dtype != dtype or dtype not in DTYPES or t.stride(-1) != 1 or t.device.type != "cpu":
            raise ValueError(
                f"layer_ops.{operation} takes CPU tensors of one dtype in {DTYPES} whose last dimension is contiguous; "
                f"got {[(str(t.dtype), tuple(t.stride())) for t in tensors]}. Call the model's own operation."
            )
        if (t.dim() == 3 and t.stride(1) != t.shape[2]) or (
            operation == "rotate" and index > 1 and not t.is_contiguous()
        ):
            raise ValueError(
                f"layer_ops.{operation} needs contiguous heads, and contiguous cos and sin; got strides "
                f"{[tuple(t.stride()) for t in tensors]}."
            )


def _bf16(x: torch.Tensor) -> int:
    return int(x.dtype == torch.bfloat16)


def _call(name: str, *arguments: object) -> None:
    functions, reason = _load()
    if functions is None:
        raise RuntimeError(f"layer_ops.{name} cannot run here: {reason}")
    functions[name](*arguments)


@functools.cache
def _load() -> tuple[dict[str, Callable[..., int]] | None, str | None]:
    """({name: the kernel's function}, None), or (None, why not); the reason is logged once."""
    return native_build.load_functions(
        _SOURCE,
        _SIGNATURES,
        switch=ENV_SWITCH,
        kernel="fused layer operations",
        fallback="the models' own operations",
        wide=True,
    )
