"""The slot decoder's stacked projections: where its layers run on oneDNN's pre-packed weights (bf16 on a CPU with
bf16 kernels), q, k and v, and gate and up, run as one product each over their stacked weights. Each output is the
same sum, so the logits are bit for bit those of the separate products; biases (Qwen2) stack with them, a layer
that computes more than `x @ W.T + b` (LoRA) runs on its own, and a weight sync re-stacks."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from lightning_grpo.models import tiny_llama
from lightning_grpo.models.packed_matmul import packing_available
from lightning_grpo.rollout import decode_linears
from lightning_grpo.rollout.decoder import SlotDecoder

pytestmark = pytest.mark.skipif(
    not packing_available(torch.bfloat16), reason="oneDNN has no bf16 kernels on this CPU: bf16 layers run unpacked"
)
PROMPTS = [[2, *range(10, 30), 3, 2], [2, *range(40, 52), 3, 2]]


def tiny_qwen2() -> Qwen2ForCausalLM:
    """A tiny Qwen2 (q, k and v with biases), random, seeded."""
    config = Qwen2Config(
        vocab_size=100, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:  # non-zero biases, so that a dropped one shows
            for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                projection.bias.normal_(0, 0.5)
    return model


def separate(model, monkeypatch) -> SlotDecoder:
    """A decoder of `model` whose projections run one product each."""
    with monkeypatch.context() as patch:
        patch.setattr(decode_linears.Stacked, "applies", staticmethod(lambda modules, packed: False))
        return SlotDecoder(model, packed=True)


def logits_of(slot_decoder: SlotDecoder, steps: int = 12) -> list[torch.Tensor]:
    """Each step's logits: both prompts prefilled, 4 rows of each, then `steps` decode steps on fixed tokens."""
    slot_decoder.reserve(8, 64)
    first, prefixes = slot_decoder.step(torch.zeros(0, dtype=torch.long), PROMPTS)
    for i, prefix in enumerate(prefixes):
        slot_decoder.load(prefix, list(range(4 * i, 4 * i + 4)))
    out = [first.clone(), *(p.logits for p in prefixes)]
    tokens = torch.Generator().manual_seed(0)
    for _ in range(steps):
        logits, _ = slot_decoder.step(torch.randint(4, 100, (8,), generator=tokens), [])
        out.append(logits.clone())
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_stacked_projections_give_the_separate_products_logits_bit_for_bit(family, monkeypatch):
    model = (tiny_llama(seed=0) if family == "llama" else tiny_qwen2()).to(torch.bfloat16).eval()
    stacked = SlotDecoder(model, packed=True)
    assert all(
        isinstance(layer.qkv, decode_linears.Stacked) and isinstance(layer.gate_up, decode_linears.Stacked)
        for layer in stacked._layers
    )
    reference = separate(model, monkeypatch)
    assert isinstance(reference._layers[0].qkv, decode_linears.Separate)
    for got, expected in zip(logits_of(stacked), logits_of(reference), strict=True):
        assert torch.equal(got, expected)


def test_a_layer_that_computes_more_than_its_weight_runs_on_its_own():
    """A LoRA-wrapped projection (its own forward adds the adapter's product) is not stacked with its neighbours."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(seed=0), LoraConfig(r=4, target_modules=["q_proj", "up_proj"]))
    base = model.base_model.model.to(torch.bfloat16).eval()
    layer = SlotDecoder(base, packed=True)._layers[0]
    assert isinstance(layer.qkv, decode_linears.Separate) and isinstance(layer.gate_up, decode_linears.Separate)


def test_a_sync_re_stacks_the_weights(monkeypatch):
    """Weights changed in place reach the stacked products at `repack()`, as they reach the separate ones."""
    model = tiny_qwen2().to(torch.bfloat16).eval()
    stacked, reference = SlotDecoder(model, packed=True), separate(model, monkeypatch)
    before = logits_of(SlotDecoder(model, packed=True), steps=2)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1.5)
    stacked.repack()
    reference.repack()
    after = logits_of(stacked, steps=2)
    assert all(torch.equal(a, b) for a, b in zip(after, logits_of(reference, steps=2), strict=True))
    assert not torch.equal(after[-1], before[-1])
