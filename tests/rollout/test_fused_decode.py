"""A decode step's layers in one C call (`rollout/fused_decode.c`): the logits it gives against the decoder's layers
run one call at a time, over several decode steps of rows that share a prompt and rows that do not, for the families
it takes (with a bias, with int8 weights, on two threads); the caches and weights it follows when they change; a
row's result alone and in a batch; the layers it refuses and why; and its switch.

The fused layers call the AMX tile kernel, so most of these run only on a CPU with AMX tiles; the refusals are
checked everywhere."""

from __future__ import annotations

import sys

import pytest
import torch

from lightning_grpo.models import tiny_llama
from lightning_grpo.rollout import fused_decode, tile_matmul
from lightning_grpo.rollout.decoder import SlotDecoder

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1]))
from helpers.model_zoo import zoo_model  # noqa: E402

needs_fused = pytest.mark.skipif(not fused_decode.available(), reason=f"{fused_decode.unavailable_reason()}")
PROMPTS = [[2, 40, 41, 42, 43, 44, 45], [2, 50, 51]]


def _decode(model, fused: bool, rows: int = 6, steps: int = 12, int8: bool = False) -> torch.Tensor:
    """Logits (steps, rows, vocab) of `steps` decode steps: rows 0-3 from the first prompt (a shared prefix), the
    rest from the second; each step feeds tokens that depend only on the step (not on the logits)."""
    decoder = SlotDecoder(model, packed=True, int8_weights=int8)
    assert (decoder.fused is not None) == fused_decode.available(), decoder.fused_refusal
    if not fused:
        decoder.fused = None
    _, prefixes = decoder.step(torch.zeros(0, dtype=torch.long), PROMPTS)
    decoder.reserve(rows, 8)  # the caches grow (and are replaced) during the steps below
    decoder.load(prefixes[0], list(range(4)))
    decoder.load(prefixes[1], list(range(4, rows)))
    vocab = model.config.vocab_size
    out = []
    for step in range(steps):
        tokens = (torch.arange(rows) * 7 + step * 13 + 5) % vocab
        decoder.reserve(rows, int(decoder.lengths[:rows].max()) + 1)
        logits, _ = decoder.step(tokens, [])
        out.append(logits.float())
    return torch.stack(out)


def _bf16(model):
    return model.to(torch.bfloat16).eval()


@needs_fused
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_fused_layers_give_the_layer_by_layer_logits_bit_for_bit(family):
    """qwen2's q/k/v have a bias; llama's and mistral's none. The caches grow twice during the steps."""
    model = _bf16(zoo_model(family, seed=1))
    assert torch.equal(_decode(model, fused=True), _decode(model, fused=False))


@needs_fused
def test_the_tiny_llama_and_its_int8_weights_run_fused_as_layer_by_layer(kernel_threads):
    """int8 tiles where the CPU has AMX-INT8; and every weight split between two threads (the same sums)."""
    model = _bf16(tiny_llama(seed=3))
    expected = _decode(model, fused=False)
    assert torch.equal(_decode(model, fused=True), expected)
    kernel_threads(2, tile_matmul)
    assert torch.equal(_decode(model, fused=True), expected)
    if tile_matmul.int8_available():
        assert torch.equal(_decode(model, fused=True, int8=True), _decode(model, fused=False, int8=True))


@needs_fused
def test_a_rows_fused_logits_do_not_depend_on_the_other_rows():
    model = _bf16(tiny_llama(seed=4))
    assert torch.equal(_decode(model, fused=True, rows=1), _decode(model, fused=True, rows=6)[:, :1])


@needs_fused
def test_weights_changed_in_place_and_repacked_are_used_at_the_next_fused_step():
    model = _bf16(tiny_llama(seed=5))
    decoder = SlotDecoder(model, packed=True)
    _, (prefix,) = decoder.step(torch.zeros(0, dtype=torch.long), PROMPTS[:1])
    decoder.reserve(2, 16)
    decoder.load(prefix, [0, 1])
    before, _ = decoder.step(torch.tensor([5, 6]), [])
    with torch.no_grad():
        for parameter in model.model.layers.parameters():
            parameter.mul_(1.5)
    decoder.repack()
    after = _step_again(decoder)
    decoder.fused = None
    layer_by_layer = _step_again(decoder)
    assert not torch.equal(after, before)
    assert torch.equal(after, layer_by_layer)


@needs_fused
def test_a_full_slot_is_refused_before_anything_is_written():
    """The C layers would write a row's key and value past its slot: the step refuses, naming the position."""
    decoder = SlotDecoder(_bf16(tiny_llama(seed=6)), packed=True)
    _, (prefix,) = decoder.step(torch.zeros(0, dtype=torch.long), PROMPTS[:1])
    decoder.reserve(2, len(PROMPTS[0]))
    decoder.load(prefix, [0, 1])
    with torch.inference_mode():
        decoder.lengths[1] = decoder.capacity
    keys = [cache.clone() for cache in decoder._keys]
    with pytest.raises(ValueError, match=f"a slot is full: position {decoder.capacity} of capacity"):
        decoder.step(torch.tensor([5, 6]), [])
    assert all(torch.equal(before, after) for before, after in zip(keys, decoder._keys, strict=True))


def _step_again(decoder: SlotDecoder) -> torch.Tensor:
    """The last step's logits computed again (its rows' new keys and values overwritten)."""
    with torch.inference_mode():
        decoder.lengths[:2] -= 1
    return decoder.step(torch.tensor([5, 6]), [])[0]


@pytest.mark.parametrize(
    ("family", "reason"),
    [
        ("qwen3", "q/k norms, a sliding window or softcapped scores"),
        ("mistral_window", "q/k norms, a sliding window or softcapped scores"),
        ("gemma2", "norms after the branches, or a residual multiplier"),
        ("olmo2", "norms after the branches, or a residual multiplier"),
        ("granite", "norms after the branches, or a residual multiplier"),
        ("smollm3", "a layer without rotation, or rotations per layer type"),
        ("mixtral", "an MLP without gate, up and down projections"),
    ],
)
def test_layers_it_cannot_run_stay_layer_by_layer_and_say_why(family, reason):
    decoder = SlotDecoder(_bf16(zoo_model(family)), packed=True)
    assert decoder.fused is None
    assert decoder.fused_refusal == reason


@needs_fused
def test_a_float32_decoder_and_a_projection_not_on_tiles_are_refused():
    assert SlotDecoder(tiny_llama(seed=0), packed=True).fused_refusal == (
        "the fused layers run bf16 decoders, not torch.float32"
    )
    phi3 = SlotDecoder(_bf16(zoo_model("phi3")), packed=True)  # one fused qkv_proj, cut in Python
    assert phi3.fused_refusal == "layer 0's projections are not all stacked on AMX tiles"


def test_the_switch_turns_the_fused_layers_off(fresh_kernel_state):
    fresh_kernel_state.setenv(fused_decode.ENV_SWITCH, "0")
    decoder = SlotDecoder(_bf16(tiny_llama(seed=0)), packed=True)
    assert decoder.fused is None
    assert decoder.fused_refusal == f"{fused_decode.ENV_SWITCH}=0"
