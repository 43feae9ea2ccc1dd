"""The linear layers of a decode step (`decoder.SlotDecoder`): each `nn.Linear` of the model run through the fastest
product this CPU has for the step's few rows, with the same weights.

- float32, up to `small_matmul.MAX_ROWS` rows: the small-batch kernel (`small_matmul`), reading the module's weight
  at each call.
- packed (`packed=True`): the weight laid out once for a packed product (`packed_product`): AMX tiles where the CPU
  has them (`tile_matmul`), else oneDNN (`models.packed_matmul`); `pack()` lays it out again after the module's
  weight changed in place (a weight sync). With `int8=True` a bf16 weight is rounded to int8 per output feature and
  laid out as int8 tiles, where the CPU has AMX-INT8 (`int8_refusal`).
- anything else, and a subclass of `nn.Linear` (a LoRA or quantised layer, which computes more): the module itself.

Projections that read the same input (q, k and v; gate and up) run as one packed product over their stacked weights
(`Stacked`), and a family's fused projection (Phi-3's `qkv_proj`) as one product cut into its parts (`Split`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import get_args

import torch

from ..models.packed_matmul import pack_weight, packed_linear, packing_available
from ..options import GeneratorQuantization as Quantization
from . import small_matmul, tile_matmul

#: The smallest LM head worth packing in float32 (a vocabulary of thousands of tokens; smaller layers run slower
#: packed, measured on fp32 CPUs).
PACK_MIN_NUMEL = 1 << 22

Product = Callable[[torch.Tensor], torch.Tensor]
#: What `EmbeddedGenerator(quantization=...)` takes besides None.
QUANTIZATIONS: tuple[Quantization, ...] = get_args(Quantization)


def int8_refusal(dtype: torch.dtype) -> str | None:
    """Why a decoder in `dtype` cannot run int8 weights here (`packed_product(..., int8=True)`), or None when it
    can: they need a bf16 decoder and the AMX tile kernel with amx_int8 (`tile_matmul.int8_available`)."""
    if dtype != torch.bfloat16:
        return f"int8 weights run in a bf16 generator, and this one samples in {str(dtype).removeprefix('torch.')}"
    if not tile_matmul.available():
        return f"int8 weights run on AMX tiles: {tile_matmul.unavailable_reason()}"
    if not tile_matmul.int8_available():
        return f"int8 weights run on AMX tiles, and the CPU has no {', '.join(tile_matmul.NEEDED_INT8)}"
    return None


def packed_product(weight: torch.Tensor, bias: torch.Tensor | None, int8: bool = False) -> Product:
    """`x -> x @ weight.T + bias` on `weight` laid out once: on AMX tiles where `tile_matmul` is available and takes
    the weight (bf16, in_features a multiple of 32), else through oneDNN (`models.packed_matmul.packing_available`).
    With `int8`, a weight the int8 tiles take (in_features a multiple of 64, where `int8_refusal` is None) is rounded
    to int8 per output feature (`tile_matmul.quantize`) and multiplied on them. The layout is a copy: lay it out
    again after `weight` changes."""
    weight = weight.detach()
    if int8 and tile_matmul.takes(weight, bias, int8=True) and int8_refusal(weight.dtype) is None:
        return TileProduct(tile_matmul.pack(weight, bias, int8=True))
    if tile_matmul.takes(weight, bias) and tile_matmul.available():
        return TileProduct(tile_matmul.pack(weight, bias))
    packed = pack_weight(weight)
    return lambda x: packed_linear(x, packed, bias)


@dataclass(frozen=True, slots=True)
class TileProduct:
    """A packed product on AMX tiles, `x -> tile_matmul.linear(x, weight)`, whose tiles a caller may hand to C
    (`fused_decode`)."""

    weight: tile_matmul.TileWeight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return tile_matmul.linear(x, self.weight)


def tiles_of(product: Product | None) -> tile_matmul.TileWeight | None:
    """The tiles a product multiplies by, where it is a `TileProduct`; else None."""
    return product.weight if isinstance(product, TileProduct) else None


def decode_product(weight: torch.Tensor) -> Product:
    """`x -> x @ weight.T` as a decode step runs a bias-free layer of this weight: a `Linear`, packed where
    `SlotDecoder` packs the layers (bf16 with `packing_available`; fp32 layers run the small-batch kernel). What
    the precision probe times for the generator (`models.dtype_probe.probe_matmul_precision(decode_product=...)`)."""
    out_features, in_features = weight.shape
    module = torch.nn.Linear(in_features, out_features, bias=False, dtype=weight.dtype)
    with torch.no_grad():
        module.weight.copy_(weight)
    return Linear(module, packed=weight.dtype == torch.bfloat16 and packing_available(weight.dtype))


class Linear:
    """A `nn.Linear` of the model as a decode step runs it: through the small-batch kernel (`small_matmul`) when it
    is available and takes the step's rows; else through a packed product (`packed_product`, int8 with `int8`) when
    asked; else the module. `pack()` lays the weight out again after the module's weight changed in place. The
    small-batch kernel and the module read the weight at each call, so weights copied into the model are used at the
    next step."""

    def __init__(self, module: torch.nn.Module, packed: bool = False, int8: bool = False) -> None:
        self.module = module
        self._int8 = int8
        # a subclass (a LoRA or quantised layer) computes more than `x @ weight.T + bias`
        self._small = type(module) is torch.nn.Linear and small_matmul.available()
        self._product: Product | None = None
        self._use_packed = packed and type(module) is torch.nn.Linear  # for steps the kernel does not take
        self.pack()

    def pack(self) -> None:
        if self._use_packed:
            with torch.inference_mode():
                bias = None if self.module.bias is None else self.module.bias.detach()
                self._product = packed_product(self.module.weight, bias, self._int8)

    @property
    def tiles(self) -> tile_matmul.TileWeight | None:
        """The AMX tiles every step's product runs on (a bf16 packed layer; the small-batch kernel is float32), or
        None."""
        return tiles_of(self._product)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._small and small_matmul.applies(x, self.module.weight, self.module.bias):
            return small_matmul.linear(x, self.module.weight, self.module.bias)
        if self._product is None:
            return self.module(x)
        return self._product(x)


class Stacked:
    """Linear layers that read the same input (q, k and v; gate and up) run as one packed product over their weights
    stacked: one wide product instead of several narrow ones, each output the same sum. Returns each layer's output
    (column slices of one tensor), through int8 tiles with `int8`. `pack()` re-stacks after the modules' weights
    changed in place."""

    def __init__(self, modules: list[torch.nn.Module], int8: bool = False) -> None:
        self.modules = modules
        self._int8 = int8
        self._widths = [module.out_features for module in modules]
        self.pack()

    @staticmethod
    def applies(modules: list[torch.nn.Module], packed: bool) -> bool:
        """Whether `modules` can run stacked: packed, plain `nn.Linear`s (a LoRA or quantised layer computes more),
        all with a bias or none."""
        plain = all(type(module) is torch.nn.Linear for module in modules)
        return packed and plain and len({module.bias is None for module in modules}) == 1

    def pack(self) -> None:
        with torch.inference_mode():
            weight = torch.cat([module.weight.detach() for module in self.modules])
            biased = self.modules[0].bias is not None
            bias = torch.cat([module.bias.detach() for module in self.modules]) if biased else None
            self._product = packed_product(weight, bias, self._int8)

    @property
    def tiles(self) -> tile_matmul.TileWeight | None:
        """The AMX tiles of the stacked weight (the layers' outputs side by side, in order), or None."""
        return tiles_of(self._product)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self._product(x).split(self._widths, dim=-1)


class Separate:
    """Linear layers that read the same input, each run as its `Linear` (where `Stacked` does not apply)."""

    def __init__(self, modules: list[torch.nn.Module], packed: bool, int8: bool = False) -> None:
        self._linears = [Linear(module, packed, int8) for module in modules]

    def pack(self) -> None:
        for linear in self._linears:
            linear.pack()

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(linear(x) for linear in self._linears)


class Split:
    """One linear layer whose output is several layers' (Phi-3's `qkv_proj`, `gate_up_proj`): one product, returned
    as its column slices of `widths`."""

    def __init__(self, module: torch.nn.Module, widths: list[int], packed: bool, int8: bool = False) -> None:
        self._linear = Linear(module, packed, int8)
        self._widths = widths

    def pack(self) -> None:
        self._linear.pack()

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self._linear(x).split(self._widths, dim=-1)


def projections(
    owner: torch.nn.Module, names: tuple[str, ...], fused: str, widths: list[int], packed: bool, int8: bool = False
) -> Stacked | Separate | Split:
    """The projections `names` of `owner` as one callable returning each one's output, from its fused layer
    `fused` where the family has one."""
    if isinstance(getattr(owner, fused, None), torch.nn.Module):
        return Split(getattr(owner, fused), widths, packed, int8)
    modules = [getattr(owner, name) for name in names]
    return Stacked(modules, int8) if Stacked.applies(modules, packed) else Separate(modules, packed, int8)
