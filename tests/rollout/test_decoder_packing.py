"""`SlotDecoder(packed=True)` on a CPU where oneDNN cannot pack the model's dtype (bf16 on an AVX2-only CPU): the
layers run unpacked, as with `packed=False`, instead of failing on oneDNN's refusal.

The CPU without bf16 kernels is faked, strictly: `packing_available` says no for bf16, and any packing raises the
error oneDNN raises there, so a decoder that packed anyway fails the test."""

from __future__ import annotations

import torch

from lightning_grpo.models import tiny_llama
from lightning_grpo.rollout import decode_linears, decoder
from lightning_grpo.rollout.decoder import SlotDecoder

PROMPTS = [[2, *range(10, 30), 3, 2], [2, *range(40, 52), 3, 2]]


def prefill_logits(slot_decoder: SlotDecoder) -> list[torch.Tensor]:
    """The logits of both prompts' prefill."""
    slot_decoder.reserve(2, 64)
    _, prefixes = slot_decoder.step(torch.zeros(0, dtype=torch.long), PROMPTS)
    return [prefix.logits.clone() for prefix in prefixes]


def test_a_bf16_decoder_asked_to_pack_where_onednn_has_no_bf16_kernels_runs_unpacked(monkeypatch):
    model = tiny_llama(seed=0).to(torch.bfloat16).eval()
    expected = prefill_logits(SlotDecoder(model, packed=False))

    def refuse(weight, *args, **kwargs):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx512bw")

    monkeypatch.setattr(decoder, "packing_available", lambda dtype: dtype != torch.bfloat16)
    monkeypatch.setattr(decode_linears, "packed_product", refuse)
    got = prefill_logits(SlotDecoder(model, packed=True))
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
