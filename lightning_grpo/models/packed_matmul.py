"""Linear layers through oneDNN on weights laid out for it beforehand ("packed"): `x @ weight.T + bias` for few rows.

Packing once and multiplying many times is about twice as fast as torch's default CPU GEMM for a vocabulary-sized fp32
layer, and faster for every bf16 layer where oneDNN has bf16 kernels. The embedded generator packs its layers
(`rollout.decoder`); the precision probe times packed products (`models.dtype_probe`). Check `packing_available(dtype)`
before packing: the ops are torch's `mkldnn` ones, present only in builds with oneDNN.

Example::

    if packing_available(weight.dtype):
        packed = pack_weight(weight)  # once, and again after each change of `weight`
        y = packed_linear(x, packed, bias)  # x @ weight.T + bias
"""

from __future__ import annotations

import torch

#: The batch size oneDNN lays packed weights out for (it serves any batch size).
PACK_ROWS = 32
# Row counts are rounded up to these steps (up to `_FINE_ROWS` rows, then `_COARSE_STEP`): oneDNN builds and caches
# one kernel per distinct shape, so a generator whose batch and prompt lengths vary would otherwise build a kernel at
# most steps (slower than the product itself) and keep every one (memory growing for hours).
_FINE_ROWS, _FINE_STEP, _COARSE_STEP = 64, 8, 64


def packing_available(dtype: torch.dtype) -> bool:
    """Whether torch can run linear layers of `dtype` (fp32, or bf16 where oneDNN has bf16 kernels on this CPU)
    through oneDNN with pre-packed weights."""
    ops = torch.ops.mkldnn
    supported = dtype == torch.float32 or (dtype == torch.bfloat16 and _mkldnn_bf16())
    return (
        supported
        and torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


def pack_weight(weight: torch.Tensor, rows: int = PACK_ROWS) -> torch.Tensor:
    """`weight` (out, in) laid out by oneDNN for products of about `rows` rows (where `packing_available`)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, rows)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T + bias` through oneDNN on a weight `pack_weight` laid out.

    `x` is `(rows, in)`; it runs padded with zero rows to `padded_rows(rows)` (a few kernel shapes serve every row
    count) and the padding's outputs are dropped."""
    rows = x.shape[0]
    padded = padded_rows(rows)
    if padded != rows:
        x = torch.nn.functional.pad(x, (0, 0, 0, padded - rows))
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")[:rows]


def padded_rows(rows: int) -> int:
    """The row count a product of `rows` rows runs at: a multiple of 8 up to 64 rows, then of 64."""
    step = _FINE_STEP if rows <= _FINE_ROWS else _COARSE_STEP
    return -(-rows // step) * step


def _mkldnn_bf16() -> bool:
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check is not None and check())
