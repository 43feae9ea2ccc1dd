"""The embedded generator's architecture table: Gemma 3 (sliding-window and global layers, q/k norms, sandwich norms,
(1 + weight) RMSNorm, scaled embedding, rotary base per layer type) and Qwen2 at Qwen2.5-0.5B's shapes sample with
the logprobs of a teacher-forced forward of the same model; what the decoder does not implement is refused with the
way out. Random-weight models built from their configs (the real gemma-3-270m: tests/models/test_gemma3.py)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lightning_grpo.models import tiny_gemma3
from lightning_grpo.rollout.architectures import ARCHITECTURES, architecture_of, layer_rotary_types, layer_windows
from lightning_grpo.rollout.generator import EmbeddedGenerator, GeneratorSpec, PolicySpec
from lightning_grpo.rollout.sampling import teacher_forced_logprobs

# Longer and shorter than the tiny Gemma 3's window of 4, so prefills and decode steps both cross it.
PROMPTS = [[2, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49], [2, 50, 51], [2, 60, 61, 62, 63, 64], [2, 70]]


def sample_errors(model, reference, prompts, **options) -> list[float]:
    """Generate from every prompt at once; each completion's largest logprob error against `reference`."""

    async def run(generator):
        return await asyncio.gather(*(generator.generate(p, seed=i) for i, p in enumerate(prompts)))

    temperature = options.get("temperature", 1.0)
    with EmbeddedGenerator(model, eos_token_ids=[], seed=0, **options) as generator:
        outputs = asyncio.run(run(generator))
    assert all(len(o.token_ids) == options["max_tokens"] for o in outputs)
    return [
        (teacher_forced_logprobs(reference, p, o.token_ids, temperature) - torch.tensor(o.logprobs)).abs().max().item()
        for p, o in zip(prompts, outputs, strict=True)
    ]


def qwen2_at_qwen25_shapes(vocab_size: int = 4096) -> torch.nn.Module:
    """Qwen2.5-0.5B's public config (hidden 896, 14 query heads sharing 2 KV heads of 64, MLP 4864, q/k/v biases,
    tied embeddings, rope base 1e6) with 2 of its 24 layers and its 151,936-token vocabulary cut to `vocab_size`."""
    config = AutoConfig.for_model(
        "qwen2",
        vocab_size=vocab_size,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=2,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        use_sliding_window=False,
        sliding_window=32768,
        max_window_layers=21,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gemma3_samples_with_the_logprobs_of_a_teacher_forced_forward_across_its_sliding_window(temperature):
    """Prompts of 11, 3, 6 and 1 tokens and 12 new tokens each, against a window of 4: a wrong window, rotary base,
    norm or embedding scale would be off by far more than float rounding."""
    errors = sample_errors(tiny_gemma3(0), tiny_gemma3(0), PROMPTS, temperature=temperature, max_tokens=12)
    assert max(errors) <= 1e-4, errors


def test_the_gemma3_check_can_fail_a_window_the_decoder_ignores_is_caught():
    """The reference with a wider window (the same weights) disagrees with the generator: the test above sees it."""
    errors = sample_errors(tiny_gemma3(0), tiny_gemma3(0, sliding_window=64), PROMPTS[:1], max_tokens=12)
    assert max(errors) > 1e-2, errors


def test_gemma3_layers_get_their_window_and_rotary_type_from_the_config():
    config = tiny_gemma3(0).config
    assert layer_windows(config) == [4, None, 4]
    assert layer_rotary_types(config) == ["sliding_attention", "full_attention", "sliding_attention"]
    assert architecture_of(config).norms[1] == "post_attention_layernorm"


def test_qwen2_at_qwen25_0_5b_shapes_samples_with_exact_logprobs():
    model = qwen2_at_qwen25_shapes()
    assert model.model.layers[0].self_attn.q_proj.bias is not None  # the biases the Llama layout lacks
    reference = qwen2_at_qwen25_shapes()
    errors = sample_errors(model, reference, PROMPTS, max_tokens=6)
    assert max(errors) <= 1e-4, errors
    assert layer_windows(model.config) == [None, None]


@pytest.mark.parametrize(
    ("model_type", "options", "message"),
    [
        ("gemma3_text", {"attn_logit_softcapping": 50.0}, r"attn_logit_softcapping=50\.0"),
        ("gemma3_text", {"final_logit_softcapping": 30.0}, r"final_logit_softcapping=30\.0"),
        ("gemma2", {}, r"model_type='gemma2'"),
        ("qwen2", {"use_sliding_window": True}, r"model_type='qwen2' with a sliding attention window"),
    ],
)
def test_what_the_decoder_does_not_implement_is_refused_with_the_fix(model_type, options, message):
    config = AutoConfig.for_model(model_type, **options).to_dict()
    with pytest.raises(ValueError, match=message + r".*generator='vllm'"):
        architecture_of(config)
    with pytest.raises(ValueError, match=message):  # in the trainer, before a child is spawned
        GeneratorSpec(PolicySpec(config=config))


def test_every_table_entry_names_norms_the_family_has():
    """Each row's norm names exist on a layer of that family (a typo would fail at the first generate)."""
    for model_type, architecture in ARCHITECTURES.items():
        config = AutoConfig.for_model(
            model_type, vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        )  # fmt: skip
        layer = AutoModelForCausalLM.from_config(config).model.layers[0]
        assert all(name is None or hasattr(layer, name) for name in architecture.norms), model_type
