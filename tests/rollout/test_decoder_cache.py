"""The slot decoder's KV cache and the decode step's attention over it, on both of its paths.

torch's operations (where the attention kernel does not run): keys stored with the positions last, so that the
products read a row's keys in place, and the attention what products over contiguous copies of the cache give, bit
for bit in bf16, within rounding in fp32. The kernel (`decode_attention`): every position's key and value contiguous,
and the attention the float64 one within the output's rounding."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from lightning_grpo.models.tiny import tiny_llama_config
from lightning_grpo.rollout import decode_attention
from lightning_grpo.rollout.decoder import SlotDecoder

PATHS = [
    "torch",
    pytest.param("kernel", marks=pytest.mark.skipif(not decode_attention.available(), reason="no kernel")),
]


def decoder(dtype: torch.dtype, path: str = "torch") -> SlotDecoder:
    config = tiny_llama_config()
    config.num_attention_heads, config.num_key_value_heads, config.hidden_size = 4, 2, 256  # 2 queries per kv head
    torch.manual_seed(0)
    slot_decoder = SlotDecoder(LlamaForCausalLM(config).to(dtype).eval())
    assert slot_decoder._attention_kernel == decode_attention.available()  # the kernel wherever it runs
    slot_decoder._attention_kernel = path == "kernel"  # before the cache exists: its layout follows the path
    return slot_decoder


@torch.inference_mode()  # the cache is made in inference mode
def fill(slot_decoder: SlotDecoder, lengths: list[int]) -> None:
    """Random keys and values in every layer, and the rows' lengths."""
    generator = torch.Generator().manual_seed(1)
    for cache in (*slot_decoder._keys, *slot_decoder._values):
        cache.copy_(torch.randn(cache.shape, generator=generator).to(cache.dtype))
    slot_decoder.lengths[: len(lengths)] = torch.tensor(lengths)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_attention_appends_each_rows_key_and_value_and_attends_to_its_slot(dtype, path):
    slot_decoder = decoder(dtype, path)
    slot_decoder.reserve(6, 100)
    lengths = [3, 40, 17, 63, 1, 29]
    fill(slot_decoder, lengths)
    rows, heads, kv_heads, dim = len(lengths), slot_decoder.heads, slot_decoder.kv_heads, slot_decoder.head_dim
    generator = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(rows, n, dim, generator=generator).to(dtype) for n in (heads, kv_heads, kv_heads))
    mask = slot_decoder._row_mask(slot_decoder.lengths[:rows], None)
    with torch.inference_mode():
        out = slot_decoder._decode_attention(0, q, k, v, mask, slot_decoder._layers[0])
    width = mask.shape[-1]
    keys = slot_decoder._keys[0][:rows, :, :width].contiguous()  # now holding k and v at each row's position
    values = slot_decoder._values[0][:rows, :, :width].contiguous()
    assert torch.equal(keys[torch.arange(rows), :, torch.tensor(lengths)], k)
    assert torch.equal(values[torch.arange(rows), :, torch.tensor(lengths)], v)
    grouped = q.view(rows, kv_heads, heads // kv_heads, dim)
    if path == "kernel":  # float32 throughout, the output rounded once
        scores = torch.matmul(grouped.double(), keys.double().transpose(-1, -2)).mul_(slot_decoder._scale)
        expected = torch.matmul(scores.add_(mask.double()).softmax(dim=-1), values.double()).view(rows, heads, dim)
        tolerance = 2**-8 if dtype == torch.bfloat16 else 1e-5  # half a bf16 ulp of values below 2; float32 sums
        torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)
        return
    scores = torch.matmul(grouped, keys.transpose(-1, -2)).mul_(slot_decoder._scale).add_(mask)
    expected = torch.matmul(scores.softmax(dim=-1), values).view(rows, heads, dim)
    if dtype == torch.bfloat16:
        assert torch.equal(out, expected)
    else:
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("path", PATHS)
def test_growing_the_cache_keeps_every_slots_keys_and_values_and_the_keys_layout(path):
    slot_decoder = decoder(torch.bfloat16, path)
    slot_decoder.reserve(3, 10)
    fill(slot_decoder, [5, 9, 2])
    before = [cache.clone() for cache in (*slot_decoder._keys, *slot_decoder._values)]
    slot_decoder.reserve(20, 300)
    assert (slot_decoder.slots, slot_decoder.capacity) == (24, 320)
    for old, new in zip(before, (*slot_decoder._keys, *slot_decoder._values), strict=True):
        slots, _, capacity, _ = old.shape
        assert torch.equal(new[:slots, :, :capacity], old)
        assert not new[slots:].any() and not new[:, :, capacity:].any()
    for keys in slot_decoder._keys:
        assert keys.shape[2:] == (320, slot_decoder.head_dim)
        if path == "torch":  # positions last in memory: a row's first keys are a matrix read in place
            assert keys.stride()[2:] == (1, 320)
        else:  # every position's key contiguous, as the kernel reads it
            assert keys.is_contiguous()


def test_a_step_with_no_rows_and_no_prompt_to_prefill_runs_nothing():
    """Every running row finished in the last step and the requests joining now all start from a prompt whose
    prefill is cached: the continuous batch asks for a step over nothing, which must give no logits, not fail."""
    slot_decoder = decoder(torch.float32)
    logits, prefixes = slot_decoder.step(torch.empty(0, dtype=torch.long), [])
    assert logits.shape == (0, slot_decoder._vocab_size) and prefixes == []
    logits, (prefix,) = slot_decoder.step(torch.empty(0, dtype=torch.long), [[2, 40, 41]])  # a prefill still runs
    assert logits.shape == (0, slot_decoder._vocab_size) and prefix.logits.shape == (slot_decoder._vocab_size,)
