"""A decode step's decoder layers in one C call (`fused_decode.c`), for Llama-like layers on AMX tiles.

Between its kernels, a decode layer run from Python makes a dozen calls (the kernels' wrappers, torch's SiLU,
product and residual adds, views and splits), each costing more to dispatch than to compute at a decode step's few
dozen rows, and none of them split between threads. `FusedLayers` hands the layers' kernels to C once and runs every
layer of a step in one call: the same kernels with the same arguments in the same order (`layer_ops.rms_norm`,
`tile_matmul.linear`, `layer_ops.rotate`, `decode_attention.attend`), and the elementwise steps between them in C,
rounded to bf16 where torch's bf16 operations round (SiLU's exp within ~2e-7 of torch's, so an output may differ
from the unfused path's by a bf16 ulp, rarely). A row's result still does not depend on the other rows.

It runs the steps without prompts to prefill (most of a generation's steps) where every layer qualifies: bf16, its
norms `layer_ops.FusedNorm`s before each branch and none after, q/k/v and gate/up stacked on AMX tiles (bf16 or
int8) and the other projections too, SiLU as the activation, rotation by `layer_ops.rotate` over the whole head, no
q/k norms, sliding window, softcap or residual multiplier, and the attention kernel on. `refusal` says why not
otherwise, and the decoder runs its layers one call at a time instead. `LIGHTNING_GRPO_FUSED_DECODE=0` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from . import decode_attention, layer_ops, native_build, tile_matmul

#: Set to "0" to run the decoder's layers one call at a time.
ENV_SWITCH = "LIGHTNING_GRPO_FUSED_DECODE"

_SOURCE = Path(__file__).with_name("fused_decode.c")
_POINTER, _INT, _DOUBLE = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double


class _Kernels(ctypes.Structure):
    _fields_ = [(name, _POINTER) for name in ("linear", "linear_int8", "attend", "norm", "rotate")]


class _Product(ctypes.Structure):
    _fields_ = [("tiles", _POINTER), ("bias", _POINTER), ("scale", _POINTER)] + [
        (name, _INT) for name in ("out_features", "in_features", "split")
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("pre_attention", _POINTER),
        ("pre_mlp", _POINTER),
        ("pre_attention_eps", _DOUBLE),
        ("pre_mlp_eps", _DOUBLE),
        *[(name, _Product) for name in ("qkv", "o", "gate_up", "down")],
        ("keys", _POINTER),
        ("values", _POINTER),
    ]


_STEP_SIZES = ("rows", "hidden", "heads", "kv_heads", "dim", "capacity", "intermediate", "groups", "threads")
_STEP_TENSORS = ("lengths", "order", "starts", "prefix", "cos", "sin")
_SCRATCH = ("x", "qkv", "q", "k", "v", "attended", "branch", "gate_up", "act")


class _Step(ctypes.Structure):
    _fields_ = [
        *[(name, _INT) for name in (*_STEP_SIZES, "attention_threads")],
        ("scale", _DOUBLE),
        *[(name, _POINTER) for name in (*_STEP_TENSORS, *_SCRATCH)],
    ]


@dataclass(frozen=True, slots=True)
class LayerParts:
    """What `FusedLayers` runs of one decoder layer: its norms before the attention and the MLP, its stacked q/k/v
    and gate/up projections, its o and down projections (`decode_linears` objects) and the MLP's activation."""

    pre_attention: Callable[[torch.Tensor], torch.Tensor]
    pre_mlp: Callable[[torch.Tensor], torch.Tensor]
    qkv: object  # `decode_linears.Stacked` where it runs fused (its `tiles`); `Separate` and `Split` have none
    o: object
    gate_up: object
    down: object
    act: Callable[[torch.Tensor], torch.Tensor]


def available() -> bool:
    """Whether the fused layers can run here: built and loaded, and the kernels they call available."""
    return _load()[0] is not None


def unavailable_reason() -> str | None:
    """Why the fused layers cannot run here, or None when they can."""
    return _load()[1]


def refusal(parts: list[LayerParts], dtype: torch.dtype) -> str | None:
    """Why `parts` cannot run fused in `dtype` (see the module's docstring), or None when they can."""
    if not available():
        return unavailable_reason()
    if dtype != torch.bfloat16:
        return f"the fused layers run bf16 decoders, not {dtype}"
    for index, layer in enumerate(parts):
        if not all(isinstance(norm, layer_ops.FusedNorm) for norm in (layer.pre_attention, layer.pre_mlp)):
            return f"layer {index}'s norms are not layer_ops' RMS norm"
        if any(_tiles(linear) is None for linear in (layer.qkv, layer.o, layer.gate_up, layer.down)):
            return f"layer {index}'s projections are not all stacked on AMX tiles"
        if not _is_silu(layer.act):
            return f"layer {index}'s activation is not SiLU"
    return None


class FusedLayers:
    """Runs `parts` (every decoder layer, in order; `refusal` None) over a decode step's rows in one C call.

    Args:
        parts: each layer's `LayerParts`.
        heads, kv_heads, dim: the attention's query heads, key/value heads and head dim.
        scale: the attention scores' factor (`attention.scaling`).
    """

    def __init__(self, parts: list[LayerParts], heads: int, kv_heads: int, dim: int, scale: float) -> None:
        self._parts = parts
        self._heads, self._kv_heads, self._dim, self._scale = heads, kv_heads, dim, scale
        self._hidden = _tiled(parts[0].o).out_features
        self._intermediate = _tiled(parts[0].down).in_features
        self._layers = (_Layer * len(parts))()
        self._pointed = False  # whether `_layers` points at the current caches and tiles

    def invalidate(self) -> None:
        """Say that the caches were replaced (grown) or the weights packed again: the next step points at the new
        ones."""
        self._pointed = False

    def run(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        lengths: torch.Tensor,
        groups: decode_attention.RowGroups,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
    ) -> torch.Tensor:
        """Every layer over `hidden` (rows, hidden) bf16, in place; returns it. `cos` and `sin` (rows, dim) rotate
        the rows' positions; `lengths`, `groups`, `keys` and `values` as `decode_attention.attend` takes them
        (one cache per layer)."""
        rows = hidden.shape[0]
        full = decode_attention.full_slot(lengths, keys[0].shape[2])
        if full is not None:
            raise ValueError(f"fused_decode got {full}. Reserve room first (SlotDecoder.reserve).")
        if not self._pointed:
            self._point_layers_at(keys, values)
        sizes = (rows, self._hidden, self._heads, self._kv_heads, self._dim, keys[0].shape[2], self._intermediate)
        scratch = self._scratch(rows)
        step = _Step(
            *sizes,
            groups.count,
            torch.get_num_threads(),
            decode_attention.threads_for(groups, self._kv_heads),
            self._scale,
            *[t.data_ptr() for t in (lengths, groups.order, groups.starts, groups.prefix, cos, sin, *scratch)],
        )
        library, reason = _load()
        if library is None:
            raise RuntimeError(f"fused_decode cannot run here: {reason}")
        if library.decode_layers(
            ctypes.byref(library.kernels), self._layers, len(self._parts), ctypes.byref(step), hidden.data_ptr()
        ):
            raise RuntimeError("fused_decode could not allocate a kernel's scratch memory.")
        return hidden

    def _scratch(self, rows: int) -> list[torch.Tensor]:
        """The C side's working tensors for `rows` rows, in `_SCRATCH`'s order."""
        query, kv = self._heads * self._dim, self._kv_heads * self._dim
        widths = (self._hidden, query + 2 * kv, query, kv, kv, query, self._hidden, 2 * self._intermediate)
        return [torch.empty(rows, width, dtype=torch.bfloat16) for width in (*widths, self._intermediate)]

    def _point_layers_at(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Point the C layers at the norms' weights, the tiles and the caches."""
        for layer, part, key_cache, value_cache in zip(self._layers, self._parts, keys, values, strict=True):
            pre_attention, pre_mlp = _fused_norm(part.pre_attention), _fused_norm(part.pre_mlp)
            layer.pre_attention, layer.pre_mlp = (
                pre_attention.module.weight.data_ptr(),
                pre_mlp.module.weight.data_ptr(),
            )
            layer.pre_attention_eps, layer.pre_mlp_eps = pre_attention.eps, pre_mlp.eps
            for name in ("qkv", "o", "gate_up", "down"):
                setattr(layer, name, _product(_tiled(getattr(part, name))))
            layer.keys, layer.values = key_cache.data_ptr(), value_cache.data_ptr()
        self._pointed = True


def _tiles(linear: object) -> tile_matmul.TileWeight | None:
    """The AMX tiles a `decode_linears` object multiplies by, or None (where it has none, or runs elsewhere)."""
    return getattr(linear, "tiles", None)


def _tiled(linear: object) -> tile_matmul.TileWeight:
    """The tiles of a projection `refusal` accepted."""
    tiles = _tiles(linear)
    if tiles is None:
        raise ValueError(f"fused_decode runs projections on AMX tiles; {type(linear).__name__} has none (see refusal).")
    return tiles


def _fused_norm(norm: Callable[[torch.Tensor], torch.Tensor]) -> layer_ops.FusedNorm:
    """A norm `refusal` accepted."""
    if not isinstance(norm, layer_ops.FusedNorm):
        raise ValueError(f"fused_decode runs layer_ops' RMS norm, not {norm!r} (see refusal).")
    return norm


def _product(tiles: tile_matmul.TileWeight) -> _Product:
    """A packed weight as the C side reads it; split between threads as `tile_matmul.linear` splits it."""
    return _Product(
        tiles.tiles.data_ptr(),
        0 if tiles.bias is None else tiles.bias.data_ptr(),
        0 if tiles.scale is None else tiles.scale.data_ptr(),
        tiles.out_features,
        tiles.in_features,
        int(tiles.out_features * tiles.in_features >= tile_matmul.SPLIT_MIN_NUMEL),
    )


def _is_silu(act: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """Whether `act` is SiLU, on a probe (a module's class name would miss equivalent ones)."""
    probe = torch.linspace(-8, 8, 97).to(torch.bfloat16)
    with torch.inference_mode():
        return torch.equal(act(probe), F.silu(probe))


@dataclass(frozen=True, slots=True)
class _Library:
    """The C function that runs the layers, and the kernels it is handed."""

    decode_layers: Callable[..., int]
    kernels: _Kernels


@functools.cache
def _load() -> tuple[_Library | None, str | None]:
    """(the fused layers' C function and the kernels it calls, None), or (None, why they cannot run here)."""
    function, reason = native_build.load_function(
        _SOURCE,
        "decode_layers",
        [_POINTER, _POINTER, _INT, _POINTER, _POINTER],
        switch=ENV_SWITCH,
        kernel="fused decode layers",
        fallback="the layers one call at a time",
        wide=True,
    )
    if function is None:
        return None, reason
    tiles, norms, attend = tile_matmul.c_functions(), layer_ops.c_functions(), decode_attention.c_function()
    if not tiles:
        return None, f"the AMX tile kernel is off: {tile_matmul.unavailable_reason()}"
    if not norms:
        return None, f"the fused norms are off: {layer_ops.unavailable_reason()}"
    if not attend:
        return None, f"the attention kernel is off: {decode_attention.unavailable_reason()}"
    kernels = _Kernels(tiles["tile_linear"], tiles["tile_linear_int8"], attend, norms["rms_norm"], norms["rotate"])
    return _Library(function, kernels), None
