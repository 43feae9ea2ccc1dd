"""The embedded generator's architecture table: Gemma 3 (sliding-window and global layers, q/k norms, sandwich norms,
(1 + weight) RMSNorm, scaled embedding, rotary base per layer type), Qwen2 at Qwen2.5-0.5B's shapes and every other
family of `ARCHITECTURES` (the conformance zoo's tiny models, with the options that change their path) sample with
the logprobs of a teacher-forced forward of the same model; each family's departure from Llama, left out of the
reference, shows; what the decoder does not implement is refused with the way out. Random-weight models built from
their configs (the real gemma-3-270m: tests/models/test_gemma3.py)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lightning_grpo.models import tiny_gemma3
from lightning_grpo.rollout.architectures import (
    ARCHITECTURES,
    architecture_of,
    layer_rotary_types,
    layer_rotates,
    layer_windows,
)
from lightning_grpo.rollout.decoder import SlotDecoder
from lightning_grpo.rollout.generator import EmbeddedGenerator, GeneratorSpec, PolicySpec
from lightning_grpo.rollout.sampling import teacher_forced_logprobs
from tests.helpers.model_zoo import FAMILIES, zoo_config

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


def zoo_family(family: str, seed: int = 1, **changes) -> torch.nn.Module:
    """A tiny model of a zoo family with its config attributes `changes` set, its weights drawn large enough that
    every departure from Llama moves the logprobs (linear weights N(0, 0.15), norm weights their init + N(0, 0.5)):
    at the zoo's N(0, 0.02) the logits are all but uniform and a missed scale or window hides in rounding."""
    config = zoo_config(family)
    for name, value in changes.items():
        setattr(config, name, value)
    model = AutoModelForCausalLM.from_config(config).eval()
    draws = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=draws)
            if "norm" in name:
                parameter.add_(noise * 0.5)
            else:
                parameter.copy_(noise * 0.15)
    return model


_CAPS = {"attn_logit_softcapping": 2.0, "final_logit_softcapping": 5.0}  # small: the caps bend the scores and logits
_HALF_ROTARY = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
_THETA_PER_TYPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "default", "rope_theta": 500000.0},
}
_MIXED_LAYERS = ["sliding_attention", "full_attention"]
# Phi-3.5's rotary embedding (48 factors: its 96-dimension heads): long factors past 4096 positions
_LONGROPE = {"rope_type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48, "rope_theta": 1e4}
#: case -> (zoo family, config changes): each family the fast decoder runs beyond Llama, with what changes its path.
FAMILY_CASES = {
    "mistral_window": ("mistral_window", {}),
    "gemma": ("gemma", {}),
    "gemma2": ("gemma2", {**_CAPS, "query_pre_attn_scalar": 64}),
    "gemma3_softcapped": ("gemma3_text", {**_CAPS, "layer_types": _MIXED_LAYERS}),
    "phi3_half_rotary_window": ("phi3", {"rope_parameters": _HALF_ROTARY, "sliding_window": 8}),
    "olmo2": ("olmo2", {}),
    "olmo3": ("olmo3", {"layer_types": _MIXED_LAYERS, "rope_parameters": _THETA_PER_TYPE}),
    "granite": ("granite", {}),
    "smollm3": ("smollm3", {}),
    "cohere_qk_norm": ("cohere", {"use_qk_norm": True}),
    "qwen3_moe_window": ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 8}),
    "mixtral_window": ("mixtral", {"sliding_window": 8}),
}
#: (case, what the reference leaves out): the same weights without one of the family's departures from Llama.
LEFT_OUT = [
    ("mistral_window", {"sliding_window": None}),
    ("gemma2", {"attn_logit_softcapping": None}),
    ("gemma2", {"final_logit_softcapping": None}),
    ("gemma2", {"query_pre_attn_scalar": 16}),
    ("gemma2", {"sliding_window": 64}),
    ("gemma3_softcapped", {"final_logit_softcapping": None}),
    ("phi3_half_rotary_window", {"rope_parameters": {**_HALF_ROTARY, "partial_rotary_factor": 1.0}}),
    ("phi3_half_rotary_window", {"sliding_window": None}),
    ("olmo3", {"sliding_window": 64}),
    ("olmo3", {"rope_parameters": {kind: _THETA_PER_TYPE["full_attention"] for kind in _THETA_PER_TYPE}}),
    ("granite", {"embedding_multiplier": 1.0}),
    ("granite", {"residual_multiplier": 1.0}),
    ("granite", {"attention_multiplier": 0.25}),
    ("granite", {"logits_scaling": 1.0}),
    ("smollm3", {"no_rope_layers": [1, 1]}),
    ("cohere_qk_norm", {"logit_scale": 1.0}),
    ("qwen3_moe_window", {"sliding_window": None}),
    ("mixtral_window", {"sliding_window": None}),
]


@pytest.mark.parametrize("case", list(FAMILY_CASES))
def test_each_family_samples_with_the_logprobs_of_a_teacher_forced_forward(case):
    """Prompts of 11, 3, 6 and 1 tokens and 12 new tokens each, against windows of 8 where the family slides."""
    family, changes = FAMILY_CASES[case]
    model, reference = zoo_family(family, **changes), zoo_family(family, **changes)
    assert ARCHITECTURES[model.config.model_type] is architecture_of(model.config)
    errors = sample_errors(model, reference, PROMPTS, max_tokens=12)
    assert max(errors) <= 1e-4, errors


@pytest.mark.parametrize(("case", "left_out"), LEFT_OUT, ids=[f"{c}-{next(iter(o))}" for c, o in LEFT_OUT])
def test_each_departure_from_llama_moves_the_logprobs_beyond_the_tolerance(case, left_out):
    """The check above can fail: a decoder that ignored the option would be judged against this reference."""
    family, changes = FAMILY_CASES[case]
    model, reference = zoo_family(family, **changes), zoo_family(family, **{**changes, **left_out})
    assert max(sample_errors(model, reference, PROMPTS, max_tokens=12)) > 1e-2


def test_layers_get_their_window_rotary_type_and_rotation_from_the_config():
    mistral, olmo3 = zoo_config("mistral_window"), zoo_config("olmo3")
    olmo3.layer_types = _MIXED_LAYERS
    assert layer_windows(mistral) == [8, 8] and layer_windows(zoo_config("mistral")) == [None, None]
    assert layer_windows(olmo3) == [8, None] and layer_rotary_types(olmo3) == _MIXED_LAYERS
    assert layer_rotates(zoo_config("smollm3")) == [True, False] and layer_rotates(mistral) == [True, True]
    qwen3_moe = zoo_config("qwen3_moe")
    assert layer_windows(qwen3_moe) == [None, None]  # `sliding_window` is None without `use_sliding_window`


def test_a_fused_projection_runs_as_one_packed_bf16_product_cut_into_its_parts():
    """Phi-3's `qkv_proj` and `gate_up_proj` run as one pre-packed product each (bf16 on a CPU with bf16 kernels),
    cut into q, k, v and gate, up: the logits are those of the model's modules run unpacked, within bf16 rounding,
    before and after a weight sync (`repack()`)."""
    model = zoo_family("phi3", rope_parameters=_HALF_ROTARY).to(torch.bfloat16)
    packed = SlotDecoder(model, packed=True)
    if not packed._layers[0].o._use_packed:
        pytest.skip("oneDNN has no bf16 kernels on this CPU: bf16 layers run unpacked")
    draws = torch.Generator().manual_seed(2)
    for synced in (False, True):
        if synced:
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.add_(torch.randn(parameter.shape, generator=draws).to(parameter.dtype) * 0.1)
            packed.repack()
        _, prefixes = packed.step(torch.empty(0, dtype=torch.long), PROMPTS)
        _, expected = SlotDecoder(model, packed=False).step(torch.empty(0, dtype=torch.long), PROMPTS)
        for got, want in zip(prefixes, expected, strict=True):
            torch.testing.assert_close(got.logits, want.logits, atol=0.05, rtol=0.02)


@pytest.mark.parametrize(
    ("model_type", "options", "message"),
    [
        ("llama", {"attn_logit_softcapping": 50.0}, r"model_type='llama' with attn_logit_softcapping=50\.0"),
        ("qwen3", {"final_logit_softcapping": 30.0}, r"final_logit_softcapping=30\.0"),
        ("gemma3_text", {"use_bidirectional_attention": True}, r"use_bidirectional_attention=True"),
        ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "'dynamic'"),
        ("phi3", {"rope_parameters": _LONGROPE, "original_max_position_embeddings": 4096}, "rope_type='longrope'"),
        ("gpt2", {}, r"model_type='gpt2'"),
        ("qwen2", {"use_sliding_window": True}, r"model_type='qwen2' with a sliding attention window"),
        ("smollm3", {"use_sliding_window": True, "sliding_window": 8}, "smollm3' with a sliding attention window"),
    ],
)
def test_what_the_decoder_does_not_implement_is_refused_with_the_fix(model_type, options, message):
    config = AutoConfig.for_model(model_type, **options).to_dict()
    with pytest.raises(ValueError, match=message + r".*generator='vllm'"):
        architecture_of(config)
    with pytest.raises(ValueError, match=message):  # in the trainer, before a child is spawned
        GeneratorSpec(PolicySpec(config=config), decoder="fast")


def test_every_table_entry_names_norms_the_family_has():
    """Each row's norm names exist on a layer of that family (a typo would fail at the first generate), and the
    rest of the layer's norms are the ones the row leaves out on purpose: none is skipped unnoticed."""
    for model_type, architecture in ARCHITECTURES.items():
        family = next(name for name, (kind, _) in FAMILIES.items() if kind == model_type)
        layer = AutoModelForCausalLM.from_config(zoo_config(family)).model.layers[0]
        named = {name for name in architecture.norms if name is not None}
        assert all(hasattr(layer, name) for name in named), model_type
        assert {name for name, _ in layer.named_children() if "norm" in name} == named, model_type
