"""The embedded generator's AMX tile kernel for bf16 linear layers: its products against float64 for every leftover
of rows and columns, rows independent of their batch and of the threads, the tensors it refuses, the CPUs and
switches that turn it off, and the decoder's use of it.

The products run only on a CPU with AMX tiles (Intel Xeon from Sapphire Rapids on); elsewhere those tests skip and
the refusals are still checked."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_grpo.models import tiny_llama
from lightning_grpo.models.packed_matmul import packing_available
from lightning_grpo.rollout import decode_linears, native_build, tile_matmul
from lightning_grpo.rollout.decoder import SlotDecoder

needs_tiles = pytest.mark.skipif(not tile_matmul.available(), reason=f"{tile_matmul.unavailable_reason()}")


def _bf16(*shape: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=generator).to(torch.bfloat16)


def _within_one_rounding(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """`got` is the exact product rounded once to bf16 (half an ulp, at most 2^-8 of the value: bf16 keeps 8
    significant bits), give or take the float32 sum's own error (K additions of 2^-24 of the sum of the terms'
    magnitudes)."""
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    magnitudes = F.linear(x.double().abs(), weight.double().abs(), None if bias is None else bias.double().abs())
    allowed = exact.abs() * 2**-8 + magnitudes * (x.shape[1] + 1) * 2**-24
    error = (got.double() - exact).abs()
    assert got.dtype == torch.bfloat16 and got.shape == exact.shape
    assert bool((error <= allowed).all()), f"largest excess {(error - allowed).max().item():.3g}"


@needs_tiles
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 15, 16, 17, 31, 32, 33, 64, 65, 130])
def test_products_match_float64_for_every_leftover_of_rows_and_columns(rows, threads, kernel_threads):
    """Rows past each 16 and 32, columns not a multiple of 16 and odd counts of 16-column blocks run the kernel's
    partial tiles; K from one tile (32) to 1,536; with `threads` 2 every weight is split between two threads."""
    kernel_threads(threads, tile_matmul)
    generator = torch.Generator().manual_seed(rows)
    for columns in (1, 16, 40, 48, 100):
        for features in (32, 96, 1536):
            x, weight = _bf16(rows, features, generator=generator), _bf16(columns, features, generator=generator)
            for bias in (None, _bf16(columns, generator=generator)):
                got = tile_matmul.linear(x, tile_matmul.pack(weight, bias))
                _within_one_rounding(got, x, weight, bias)


@needs_tiles
def test_a_rows_result_does_not_depend_on_the_batch_or_the_threads(two_threads):
    """What makes a seeded completion the same alone or in a batch: each output is summed in one order."""
    generator = torch.Generator().manual_seed(0)
    x = _bf16(70, 576, generator=generator)
    packed = tile_matmul.pack(_bf16(1000, 576, generator=generator), _bf16(1000, generator=generator))
    whole = tile_matmul.linear(x, packed)
    for start, stop in ((0, 1), (5, 6), (3, 20), (16, 48), (0, 33), (30, 70), (0, 64)):
        assert torch.equal(tile_matmul.linear(x[start:stop], packed), whole[start:stop]), (start, stop)
    two_threads(tile_matmul)
    assert torch.equal(tile_matmul.linear(x, packed), whole)


@needs_tiles
def test_no_rows_give_an_empty_product():
    packed = tile_matmul.pack(torch.ones(8, 32, dtype=torch.bfloat16))
    assert tile_matmul.linear(torch.zeros(0, 32, dtype=torch.bfloat16), packed).shape == (0, 8)


def test_weights_it_does_not_take_are_refused_with_their_shapes_and_types():
    weight = torch.randn(6, 64).to(torch.bfloat16)
    assert tile_matmul.takes(weight) and tile_matmul.takes(weight, torch.zeros(6))
    refused = {
        "float32": (weight.float(), None),
        "features not a multiple of 32": (torch.randn(6, 48).to(torch.bfloat16), None),
        "a batch dimension": (weight[None], None),
        "bias of another size": (weight, torch.zeros(5)),
    }
    for what, (w, b) in refused.items():
        assert not tile_matmul.takes(w, b), what
        if tile_matmul.available():
            with pytest.raises(ValueError, match=r"tile_matmul.pack takes a bf16 CPU weight.*models.packed_matmul"):
                tile_matmul.pack(w, b)


@needs_tiles
def test_inputs_it_does_not_take_are_refused_with_their_shapes_and_types():
    packed = tile_matmul.pack(torch.randn(6, 64).to(torch.bfloat16))
    for x in (torch.randn(4, 64), torch.randn(4, 32).to(torch.bfloat16), torch.randn(2, 4, 64).to(torch.bfloat16)):
        with pytest.raises(ValueError, match=r"tile_matmul.linear takes a bf16 CPU x of shape \(rows, 64\)"):
            tile_matmul.linear(x, packed)


def test_the_off_switch_leaves_onednns_products_and_says_so(fresh_kernel_state):
    fresh_kernel_state.setenv(tile_matmul.ENV_SWITCH, "0")
    assert not tile_matmul.available()
    assert tile_matmul.unavailable_reason() == f"{tile_matmul.ENV_SWITCH}=0"
    with pytest.raises(RuntimeError, match="cannot run here: LIGHTNING_GRPO_TILE_MATMUL=0"):
        tile_matmul.pack(torch.ones(8, 32, dtype=torch.bfloat16))


def test_a_cpu_without_amx_or_without_torchs_avx512_code_is_named(fresh_kernel_state):
    capabilities = {**torch.cpu.get_capabilities(), "amx_tile": False, "amx_bf16": False}
    fresh_kernel_state.setattr(torch.cpu, "get_capabilities", lambda: capabilities)
    assert tile_matmul.unavailable_reason() == "the CPU has no amx_tile, amx_bf16"
    tile_matmul._load.cache_clear()
    fresh_kernel_state.setattr(torch.cpu, "get_capabilities", lambda: dict.fromkeys(tile_matmul.NEEDED, True))
    fresh_kernel_state.setattr(native_build, "vector_isa", lambda: "AVX2")
    assert tile_matmul.unavailable_reason() == ("torch runs its AVX2 code here, not AVX-512 (ATEN_CPU_CAPABILITY)")


PROMPT = [2, 40, 41, 42, 43]


def _one_decode_step(decoder: SlotDecoder, rows: int = 5) -> torch.Tensor:
    """Prefill `PROMPT` into `rows` slots, then one decode step in which row i feeds token 10 + i; its logits. The
    layers run one call at a time, each product from Python (the fused layers: test_fused_decode.py)."""
    decoder.fused = None
    _, (prefix,) = decoder.step(torch.zeros(0, dtype=torch.long), [PROMPT])
    decoder.reserve(rows, len(PROMPT) + 1)
    decoder.load(prefix, list(range(rows)))
    logits, _ = decoder.step(torch.arange(rows) + 10, [])
    return logits


@needs_tiles
@pytest.mark.skipif(not packing_available(torch.bfloat16), reason="the decoder packs bf16 only where oneDNN has bf16")
def test_the_decoder_runs_every_bf16_linear_layer_through_the_tiles(monkeypatch):
    """Each layer's stacked q/k/v and gate/up, o, down and the head, at prefill and decode; the logits as close to the
    model's own bf16 forward as oneDNN's packed products bring them."""
    model = tiny_llama(seed=0).to(torch.bfloat16).eval()
    ids = torch.tensor([[*PROMPT, 10 + i] for i in range(5)])
    with torch.no_grad():
        expected = model(ids).logits[:, -1].float()
    calls = []
    linear = tile_matmul.linear
    monkeypatch.setattr(tile_matmul, "linear", lambda x, w: calls.append(w.out_features) or linear(x, w))
    logits = _one_decode_step(SlotDecoder(model, packed=True)).float()
    assert len(calls) == 2 * (4 * model.config.num_hidden_layers + 1)
    monkeypatch.setattr(tile_matmul, "available", lambda: False)
    onednn = _one_decode_step(SlotDecoder(model, packed=True)).float()
    assert len(calls) == 2 * (4 * model.config.num_hidden_layers + 1)  # no more: oneDNN ran
    tiles_error, onednn_error = (logits - expected).abs().max(), (onednn - expected).abs().max()
    assert tiles_error <= max(2 * onednn_error, 2**-6), (tiles_error, onednn_error)


@needs_tiles
def test_a_packed_product_picks_the_tiles_for_bf16_and_onednn_for_the_rest():
    generator = torch.Generator().manual_seed(3)
    weight = _bf16(48, 64, generator=generator)
    x = _bf16(3, 64, generator=generator)
    assert torch.equal(decode_linears.packed_product(weight, None)(x), tile_matmul.linear(x, tile_matmul.pack(weight)))
    odd = _bf16(48, 40, generator=generator)  # 40 features: no whole tile, so oneDNN
    _within_one_rounding(decode_linears.packed_product(odd, None)(x[:, :40].contiguous()), x[:, :40], odd, None)
