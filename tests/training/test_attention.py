"""Tree attention on CPU: a packed forward equals the unpacked per-sample forward (shared prompts, forks, sample
ends, GQA), in both SDPA layouts, with sliding windows, and under TRL's registered name."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers.tiny import micro_batch, reference_logprobs, sample, shared_prompt_group
from transformers import LlamaForCausalLM

from lightning_grpo.models import tiny_llama, tiny_llama_config
from lightning_grpo.scoring.packing import pack_sequences
from lightning_grpo.training.attention import (
    TRL_TREE_ATTENTION,
    TreeAttentionPlan,
    register_tree_attention,
    tree_attention,
    tree_model_kwargs,
    use_tree_attention,
)

TOLERANCE = 1e-5


def tricky_samples() -> list[dict]:
    """Two groups with forks inside the completions, a duplicated sample, and a sample that ends inside another."""
    samples = shared_prompt_group(12, [5, 9, 3, 9, 1], seed=1)
    samples += shared_prompt_group(7, [4, 6], group_id=1, uid0=5, seed=2)
    samples.append(sample([5, 6, 7], [8, 9], uid=7, group_id=2))
    samples.append(sample([5, 6, 7], [8, 9], uid=8, group_id=2))  # identical: shares every node, its leaf too
    samples.append(sample([5, 6, 7], [8, 9, 10, 11], uid=9, group_id=2))  # continues past where uid 7 ends
    return samples


def packed_term_logprobs(model, mb: dict, layout: str | None) -> torch.Tensor:
    logits = model(**tree_model_kwargs(mb, layout=layout)).logits[0]
    labels = mb["shift_labels"][mb["token_index"]]
    return torch.log_softmax(logits[mb["token_index"]], -1).gather(1, labels[:, None]).squeeze(1)


@pytest.mark.parametrize("layout", ["auto", "segments", "dense"])
def test_packed_forward_matches_per_sample_forward_with_forks_and_sample_ends(layout):
    samples = tricky_samples()
    mb = micro_batch(samples)
    assert mb["input_ids"].numel() < sum(s["input_ids"].size for s in samples)  # prefixes really are shared
    expected, _ = reference_logprobs(tiny_llama(0), samples)
    with torch.no_grad():
        got = packed_term_logprobs(use_tree_attention(tiny_llama(0)), mb, layout)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < TOLERANCE


def test_packed_forward_matches_with_four_query_heads_sharing_two_kv_heads():
    config = tiny_llama_config()
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 4, 2, 32
    torch.manual_seed(3)
    model = LlamaForCausalLM(config).eval()
    samples = tricky_samples()
    expected, _ = reference_logprobs(model, samples)
    with torch.no_grad():
        got = packed_term_logprobs(use_tree_attention(model), micro_batch(samples), "auto")
    assert (got - expected).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("layout", ["segments", "dense"])
@pytest.mark.parametrize("window", [None, 1, 3, 6])
def test_attention_matches_per_sequence_sdpa_with_sliding_window(layout, window):
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 9, 5).tolist()
    sequences = [prompt + rng.integers(0, 9, n).tolist() for n in (4, 7, 1, 7)] + [prompt[:3]]
    packed = pack_sequences(sequences)
    n = packed["input_ids"].numel()
    query, key, value = torch.randn(1, 4, n, 16), torch.randn(1, 2, n, 16), torch.randn(1, 2, n, 16)
    plan = TreeAttentionPlan.build(
        packed["tree_kv_index"], packed["tree_cu_seqlens_q"], packed["tree_cu_seqlens_k"], layout=layout
    )
    out = plan.attend(query, key, value, sliding_window=window)[0]  # (N, H, D)
    offsets = packed["offsets"].tolist()
    for i in range(len(sequences)):
        pos = packed["positions"][offsets[i] : offsets[i + 1]]
        length = len(pos)
        gap = torch.arange(length)[:, None] - torch.arange(length)[None, :]
        mask = (gap >= 0) & (gap < window if window else True)
        ref = F.scaled_dot_product_attention(
            query[:, :, pos], key[:, :, pos], value[:, :, pos], attn_mask=mask, enable_gqa=True
        )
        assert (out[pos] - ref[0].transpose(0, 1)).abs().max().item() < TOLERANCE


def test_auto_layout_prefers_segments_for_a_group_sharing_one_prompt():
    packed = pack_sequences([[1] * 48 + [k] * 64 for k in range(2, 10)])
    plan = TreeAttentionPlan.build(packed["tree_kv_index"], packed["tree_cu_seqlens_q"], packed["tree_cu_seqlens_k"])
    assert plan.layout == "segments"
    assert len(plan.batches) == 2  # the 48-token prompt and the 64-token completions are padded separately


def test_model_switched_to_trls_tree_fa3_name_runs_on_cpu():
    register_tree_attention()
    model = tiny_llama(0)
    model.set_attn_implementation(TRL_TREE_ATTENTION)
    samples = tricky_samples()
    expected, _ = reference_logprobs(tiny_llama(0), samples)
    with torch.no_grad():  # no prebuilt plan: each layer plans for itself, as under TRL's compute_loss
        got = packed_term_logprobs(model, micro_batch(samples), layout=None)
    assert (got - expected).abs().max().item() < TOLERANCE


def test_tree_attention_without_tree_arguments_raises_with_the_fix():
    model = use_tree_attention(tiny_llama(0))
    with pytest.raises(ValueError, match="set_attn_implementation\\('sdpa'\\)"):
        model(input_ids=torch.tensor([[5, 6, 7]]))


@pytest.mark.parametrize("layout", ["segments", "dense"])
@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_softcap_and_sinks_match_the_familys_own_eager_attention_per_sequence(family, layout):
    """gemma2's logit softcap and gpt_oss's attention sinks, which SDPA lacks, run by products on the tree path and
    equal the family's own eager attention function on each sequence alone."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager

    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 9, 5).tolist()
    sequences = [prompt + rng.integers(0, 9, n).tolist() for n in (4, 7, 1)]
    packed = pack_sequences(sequences)
    n = packed["input_ids"].numel()
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, h, n, 16, generator=generator) * 3 for h in (4, 2, 2))
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = 2, False
    extra = {"softcap": 2.0} if family == "gemma2" else {}
    if family == "gpt_oss":
        module.sinks = torch.nn.Parameter(torch.randn(4, generator=generator))
    plan = TreeAttentionPlan.build(
        packed["tree_kv_index"], packed["tree_cu_seqlens_q"], packed["tree_cu_seqlens_k"], layout=layout
    )
    tree_kwargs = {key: packed[key] for key in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")}
    out, _ = tree_attention(module, query, key, value, None, tree_plan=plan, scaling=0.25, **tree_kwargs, **extra)
    eager = gemma2_eager if family == "gemma2" else gpt_oss_eager
    offsets = packed["offsets"].tolist()
    for i in range(len(sequences)):
        pos = packed["positions"][offsets[i] : offsets[i + 1]]
        length = len(pos)
        causal = torch.full((length, length), float("-inf")).triu(1)[None, None]
        ref, _ = eager(module, query[:, :, pos], key[:, :, pos], value[:, :, pos], causal, scaling=0.25, **extra)
        assert (out[0, pos] - ref[0]).abs().max().item() < TOLERANCE
    # a negative control: without the softcap or sinks the outputs differ
    plain, _ = tree_attention(torch.nn.Module(), query, key, value, None, tree_plan=plan, scaling=0.25, **tree_kwargs)
    assert (plain - out).abs().max().item() > 1e-2


@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (3, 3), (6, 1)])
def test_attention_by_products_is_sdpa_with_its_mask_and_query_groups_values_and_gradients(heads, kv_heads):
    """The half-precision CPU path's arithmetic, run in float32 here so that it must match SDPA to rounding: query
    head h reads kv head h // (heads / kv_heads), masked keys get no weight, and the gradients agree."""
    from lightning_grpo.training.attention import _attention_by_products

    generator = torch.Generator().manual_seed(heads)
    query = torch.randn(3, heads, 5, 8, generator=generator, requires_grad=True)
    key, value = (torch.randn(3, kv_heads, 7, 8, generator=generator, requires_grad=True) for _ in range(2))
    mask = torch.rand(3, 1, 5, 7, generator=generator) < 0.6
    mask[..., 0] = True  # every query sees a key
    got = _attention_by_products(query, key, value, mask, 0.3, 0.0)
    expected = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(got, expected, atol=TOLERANCE, rtol=0)
    upstream = torch.randn(got.shape, generator=generator)
    grads = torch.autograd.grad((got * upstream).sum(), (query, key, value))
    expected_grads = torch.autograd.grad((expected * upstream).sum(), (query, key, value))
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected_grad, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("layout", ["segments", "dense"])
def test_packed_forward_under_bf16_autocast_takes_the_products_and_matches_the_float32_forward(layout, monkeypatch):
    from lightning_grpo.training import attention

    calls = []
    products = attention._attention_by_products
    monkeypatch.setattr(attention, "_attention_by_products", lambda *a: calls.append(a[0].shape) or products(*a))
    samples = tricky_samples()
    mb = micro_batch(samples)
    expected, _ = reference_logprobs(tiny_llama(0), samples)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = packed_term_logprobs(use_tree_attention(tiny_llama(0)), mb, layout)
    plan = TreeAttentionPlan.build(mb["tree_kv_index"], mb["tree_cu_seqlens_q"], mb["tree_cu_seqlens_k"], layout=layout)
    assert len(calls) == tiny_llama_config().num_hidden_layers * max(len(plan.batches), 1)  # every call, every layer
    assert (got.float() - expected).abs().max().item() < 0.05  # bf16 rounding of a 2-layer model's log-probabilities
