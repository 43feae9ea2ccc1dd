"""int8 weights on AMX tiles (`tile_matmul.pack(..., int8=True)`, `EmbeddedGenerator(quantization="int8")`): the
rounding to int8 against its formula bit for bit, the products against float64 of the rounded weight for every
leftover of rows and columns, rows independent of their batch and threads, the weights and CPUs it refuses (named),
the decoder running its layers on int8 tiles with the head in bf16, and the generator's log-probabilities against a
teacher-forced forward of the rounded model.

The products run only on a CPU with AMX-INT8 tiles (Intel Xeon from Sapphire Rapids on); elsewhere those tests skip
and the refusals are still checked."""

from __future__ import annotations

import asyncio
import copy
import logging

import pytest
import torch
import torch.nn.functional as F

from lightning_grpo.models import tiny_llama
from lightning_grpo.rollout import decode_linears, tile_matmul
from lightning_grpo.rollout.decoder import SlotDecoder
from lightning_grpo.rollout.generator import EmbeddedGenerator, GeneratorSpec, PolicySpec
from lightning_grpo.rollout.sampling import teacher_forced_logprobs

needs_int8 = pytest.mark.skipif(
    not tile_matmul.int8_available(), reason=f"no AMX-INT8 tiles: {tile_matmul.unavailable_reason() or 'amx_int8'}"
)
PROMPTS = [[2, 40, 41, 42, 43, 44, 45], [2, 50, 51], [2, 60, 61, 62, 63, 64], [2, 70]]


def _bf16(*shape: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=generator).to(torch.bfloat16)


def _int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`tile_matmul.quantize`'s formula in torch (float32, as it documents): (q, scale)."""
    scale = weight.float().abs().amax(dim=1) / 127
    step = torch.where(scale > 0, scale, torch.ones_like(scale))[:, None]
    return torch.round(weight.float() / step).clamp(-127, 127).to(torch.int8), scale


def _rounded(weight: torch.Tensor) -> torch.Tensor:
    """The weight int8 tiles multiply by, in float64: q * scale, from the formula (not the kernel)."""
    q, scale = _int8(weight)
    return q.double() * scale.double()[:, None]


def _within_int8_error(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """`got` is x . rounded(weight)^T + bias rounded once to bf16 (2^-8 of the value), give or take x's split into
    two int8 rows (each element off by at most max |x_row| / (127 * 508)) times the weight's magnitudes, and the
    float32 combination's own error."""
    rounded = _rounded(weight)
    exact = F.linear(x.double(), rounded, None if bias is None else bias.double())
    magnitudes = F.linear(x.double().abs(), rounded.abs(), None if bias is None else bias.double().abs())
    split = x.double().abs().amax(dim=1, keepdim=True) / (127 * 508) * rounded.abs().sum(dim=1)[None]
    allowed = exact.abs() * 2**-8 + split + magnitudes * 2**-20
    error = (got.double() - exact).abs()
    assert got.dtype == torch.bfloat16 and got.shape == exact.shape
    assert bool((error <= allowed).all()), f"largest excess {(error - allowed).max().item():.3g}"


@needs_int8
def test_quantize_rounds_each_row_on_its_own_grid_bit_for_bit():
    generator = torch.Generator().manual_seed(0)
    weight = _bf16(40, 128, generator=generator)
    weight[3] = 0  # a row of zeros: scale 0, q 0
    weight[5, 7] = 1000.0  # an outlier widens its row's grid only
    q, scale = tile_matmul.quantize(weight)
    expected_q, expected_scale = _int8(weight)
    assert torch.equal(scale, expected_scale) and torch.equal(q, expected_q)
    assert q.abs().amax(dim=1).tolist() == [0 if row == 3 else 127 for row in range(40)]


@needs_int8
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 15, 16, 17, 33, 64, 130])
def test_int8_products_match_float64_of_the_rounded_weight_for_every_leftover(rows, threads, kernel_threads):
    """Rows past each 16 and columns past each 16 (odd counts of blocks) run partial tiles; K from one int8 tile (64)
    to 1,536; with `threads` 2 every weight is split between two threads; x holds an outlier."""
    kernel_threads(threads, tile_matmul)
    generator = torch.Generator().manual_seed(rows)
    for columns in (1, 16, 40, 100):
        for features in (64, 192, 1536):
            x, weight = _bf16(rows, features, generator=generator), _bf16(columns, features, generator=generator)
            x[0, 0] = 60.0
            for bias in (None, _bf16(columns, generator=generator)):
                got = tile_matmul.linear(x, tile_matmul.pack(weight, bias, int8=True))
                _within_int8_error(got, x, weight, bias)


@needs_int8
def test_an_int8_rows_result_does_not_depend_on_the_batch_or_the_threads(two_threads):
    generator = torch.Generator().manual_seed(0)
    x = _bf16(70, 576, generator=generator)
    packed = tile_matmul.pack(_bf16(1000, 576, generator=generator), _bf16(1000, generator=generator), int8=True)
    whole = tile_matmul.linear(x, packed)
    for start, stop in ((0, 1), (5, 6), (3, 20), (16, 48), (0, 33), (30, 70)):
        assert torch.equal(tile_matmul.linear(x[start:stop], packed), whole[start:stop]), (start, stop)
    two_threads(tile_matmul)
    assert torch.equal(tile_matmul.linear(x, packed), whole)


def test_int8_weights_it_does_not_take_and_cpus_without_amx_int8_are_named(monkeypatch):
    weight = torch.randn(6, 96).to(torch.bfloat16)  # a multiple of 32, not of 64
    assert tile_matmul.takes(weight) and not tile_matmul.takes(weight, int8=True)
    assert decode_linears.int8_refusal(torch.float32) == (
        "int8 weights run in a bf16 generator, and this one samples in float32"
    )
    if tile_matmul.available():
        with pytest.raises(ValueError, match=r"in_features a multiple of 64.*with int8=True"):
            tile_matmul.pack(weight, int8=True)
        capabilities = {**torch.cpu.get_capabilities(), "amx_int8": False}
        monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: capabilities)
        assert not tile_matmul.int8_available()
        assert (
            decode_linears.int8_refusal(torch.bfloat16) == "int8 weights run on AMX tiles, and the CPU has no amx_int8"
        )
        with pytest.raises(RuntimeError, match="cannot run int8 weights here: the CPU has no amx_int8"):
            tile_matmul.pack(torch.ones(8, 64, dtype=torch.bfloat16), int8=True)
        # a packed product asked for int8 where it cannot run multiplies the bf16 weight instead
        x = torch.randn(3, 96).to(torch.bfloat16)
        assert torch.equal(
            decode_linears.packed_product(weight, None, int8=True)(x), tile_matmul.linear(x, tile_matmul.pack(weight))
        )
    else:
        assert decode_linears.int8_refusal(torch.bfloat16).startswith("int8 weights run on AMX tiles: ")


def _rounded_model(model: torch.nn.Module) -> torch.nn.Module:
    """`model` in float32 with each decoder layer's linear weight replaced by its int8 rounding (the head and the
    embeddings as they are): the policy an int8 generator samples."""
    rounded = copy.deepcopy(model).float()
    with torch.no_grad():
        for name, module in rounded.model.layers.named_modules():
            if type(module) is torch.nn.Linear:
                module.weight.copy_(_rounded(model.model.layers.get_submodule(name).weight).float())
    return rounded.eval()


@needs_int8
def test_the_decoder_runs_each_layer_on_int8_tiles_and_the_head_on_bf16_ones(monkeypatch):
    """q/k/v and gate/up stacked, o and down on int8 tiles at prefill and decode; the head on bf16 tiles; the logits
    as close to the rounded model's as the bf16 decoder's are to the bf16 model's."""
    model = tiny_llama(seed=0).to(torch.bfloat16).eval()
    calls = []
    linear = tile_matmul.linear
    monkeypatch.setattr(tile_matmul, "linear", lambda x, w: calls.append(w.scale is not None) or linear(x, w))
    decoder = SlotDecoder(model, packed=True, int8_weights=True)
    assert decoder.int8_refusal is None
    decoder.fused = None  # each product from Python, to count them (the fused layers: test_fused_decode.py)
    _, (prefix,) = decoder.step(torch.zeros(0, dtype=torch.long), [PROMPTS[0]])
    decoder.reserve(3, len(PROMPTS[0]) + 1)
    decoder.load(prefix, [0, 1, 2])
    logits = decoder.step(torch.tensor([10, 11, 12]), [])[0].float()
    layers = model.config.num_hidden_layers
    assert calls == 2 * ([True] * 4 * layers + [False])  # prefill, then decode: 4 products a layer, then the head
    ids = torch.tensor([[*PROMPTS[0], token] for token in (10, 11, 12)])
    with torch.no_grad():
        expected = _rounded_model(model)(ids).logits[:, -1]
        unrounded = copy.deepcopy(model).float()(ids).logits[:, -1]
    error = (logits - expected).abs().max()
    assert error <= 2**-5, error
    assert (logits - unrounded).abs().max() > error  # the rounding is what the logits follow


@needs_int8
def test_an_int8_generator_samples_with_the_logprobs_of_the_rounded_model_and_says_so(caplog):
    """Its log-probabilities against a teacher-forced forward of the rounded model, as close as the bf16 generator's
    are to its own model's forward (both in bf16)."""
    model = tiny_llama(seed=0).to(torch.bfloat16)
    errors = {}
    for quantization in (None, "int8"):
        with (
            caplog.at_level(logging.INFO, logger="lightning_grpo.rollout.generator"),
            EmbeddedGenerator(
                copy.deepcopy(model), eos_token_ids=[], max_tokens=12, seed=0, quantization=quantization
            ) as generator,
        ):
            outputs = asyncio.run(_generate(generator, PROMPTS))
        reference = _rounded_model(model) if quantization else copy.deepcopy(model).float()
        errors[quantization] = max(
            (teacher_forced_logprobs(reference, p, o.token_ids) - torch.tensor(o.logprobs)).abs().max().item()
            for p, o in zip(PROMPTS, outputs, strict=True)
        )
    assert "holds the decoder layers' weights as int8" in caplog.text
    assert errors["int8"] <= 2 * errors[None] + 1e-3, errors


async def _generate(generator: EmbeddedGenerator, prompts: list[list[int]]):
    return await asyncio.gather(*(generator.generate(p) for p in prompts))


def test_a_generator_that_cannot_run_int8_samples_with_its_weights_and_logs_why(caplog):
    with (
        caplog.at_level(logging.WARNING, logger="lightning_grpo.rollout.generator"),
        EmbeddedGenerator(tiny_llama(seed=0), eos_token_ids=[], max_tokens=2, quantization="int8") as generator,
    ):
        assert len(asyncio.run(_generate(generator, PROMPTS[:1]))[0].token_ids) == 2
    assert "runs the model's own weights, not quantization='int8': int8 weights run in a bf16 generator" in caplog.text


def test_an_unknown_quantization_is_refused_before_a_child_is_spawned():
    with pytest.raises(ValueError, match=r"quantization='int4' must be one of \('int8',\) or None"):
        GeneratorSpec(PolicySpec(config=tiny_llama().config.to_dict()), quantization="int4")
