"""The slot decoder's KV cache: keys stored with the positions last, so that the decode step's products read a row's
keys in place, and the attention over them what products over contiguous copies of the cache give: bit for bit in
bf16 (where the generator runs in bf16), within rounding in fp32 (whose products sum in another order)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from lightning_grpo.models.tiny import tiny_llama_config
from lightning_grpo.rollout.decoder import SlotDecoder


def decoder(dtype: torch.dtype) -> SlotDecoder:
    config = tiny_llama_config()
    config.num_attention_heads, config.num_key_value_heads, config.hidden_size = 4, 2, 256  # 2 queries per kv head
    torch.manual_seed(0)
    return SlotDecoder(LlamaForCausalLM(config).to(dtype).eval())


@torch.inference_mode()  # the cache is made in inference mode
def fill(slot_decoder: SlotDecoder, lengths: list[int]) -> None:
    """Random keys and values in every layer, and the rows' lengths."""
    generator = torch.Generator().manual_seed(1)
    for cache in (*slot_decoder._keys, *slot_decoder._values):
        cache.copy_(torch.randn(cache.shape, generator=generator).to(cache.dtype))
    slot_decoder.lengths[: len(lengths)] = torch.tensor(lengths)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_attention_is_the_products_over_contiguous_copies(dtype):
    slot_decoder = decoder(dtype)
    slot_decoder.reserve(6, 100)
    lengths = [3, 40, 17, 63, 1, 29]
    fill(slot_decoder, lengths)
    rows, heads, kv_heads, dim = len(lengths), slot_decoder.heads, slot_decoder.kv_heads, slot_decoder.head_dim
    generator = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(rows, n, dim, generator=generator).to(dtype) for n in (heads, kv_heads, kv_heads))
    mask = slot_decoder._row_mask(slot_decoder.lengths[:rows], None)
    with torch.inference_mode():
        out = slot_decoder._decode_attention(0, q, k, v, mask)
    width = mask.shape[-1]
    keys = slot_decoder._keys[0][:rows, :, :width].contiguous()  # now holding k and v at each row's position
    values = slot_decoder._values[0][:rows, :, :width].contiguous()
    assert torch.equal(keys[torch.arange(rows), :, torch.tensor(lengths)], k)
    grouped = q.view(rows, kv_heads, heads // kv_heads, dim)
    scores = torch.matmul(grouped, keys.transpose(-1, -2)).mul_(slot_decoder._scale).add_(mask)
    expected = torch.matmul(scores.softmax(dim=-1), values).view(rows, heads, dim)
    if dtype == torch.bfloat16:
        assert torch.equal(out, expected)
    else:
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_growing_the_cache_keeps_every_slots_keys_and_values_and_the_keys_layout():
    slot_decoder = decoder(torch.bfloat16)
    slot_decoder.reserve(3, 10)
    fill(slot_decoder, [5, 9, 2])
    before = [cache.clone() for cache in (*slot_decoder._keys, *slot_decoder._values)]
    slot_decoder.reserve(20, 300)
    assert (slot_decoder.slots, slot_decoder.capacity) == (24, 320)
    for old, new in zip(before, (*slot_decoder._keys, *slot_decoder._values), strict=True):
        slots, _, capacity, _ = old.shape
        assert torch.equal(new[:slots, :, :capacity], old)
        assert not new[slots:].any() and not new[:, :, capacity:].any()
    for keys in slot_decoder._keys:  # positions last in memory: a row's first keys are a matrix read in place
        assert keys.shape[2:] == (320, slot_decoder.head_dim) and keys.stride()[2:] == (1, 320)


def test_a_step_with_no_rows_and_no_prompt_to_prefill_runs_nothing():
    """Every running row finished in the last step and the requests joining now all start from a prompt whose
    prefill is cached: the continuous batch asks for a step over nothing, which must give no logits, not fail."""
    slot_decoder = decoder(torch.float32)
    logits, prefixes = slot_decoder.step(torch.empty(0, dtype=torch.long), [])
    assert logits.shape == (0, slot_decoder._vocab_size) and prefixes == []
    logits, (prefix,) = slot_decoder.step(torch.empty(0, dtype=torch.long), [[2, 40, 41]])  # a prefill still runs
    assert logits.shape == (0, slot_decoder._vocab_size) and prefix.logits.shape == (slot_decoder._vocab_size,)
