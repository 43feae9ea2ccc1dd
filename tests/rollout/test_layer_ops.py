"""The fused norm and rotation between a decode step's products (`rollout/layer_ops.c`): each against the model's own torch
operations on strided inputs with leftover widths, in both dtypes and both vector builds; the probes that decide
where the decoder uses them; the inputs they refuse; and the switch that turns them off."""

from __future__ import annotations

import sys

import pytest
import torch
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama import modeling_llama

from lightning_grpo.rollout import layer_ops
from lightning_grpo.rollout.decoder import SlotDecoder

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1]))
from helpers.model_zoo import zoo_model  # noqa: E402

needs_kernel = pytest.mark.skipif(not layer_ops.available(), reason=f"{layer_ops.unavailable_reason()}")
DTYPES = [torch.float32, torch.bfloat16]
#: float32: sums added up in another order.
FLOAT32_RTOL = 2e-6


def strided(rows: int, width: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    """(rows, width) random values, a view of a wider tensor (rows further apart than `width`)."""
    wide = torch.randn(rows, width + 24, generator=torch.Generator().manual_seed(seed)) * scale
    return wide.to(dtype)[:, 3 : 3 + width]


def assert_torchs_within_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16: nearly every element the same bits and the rest a bf16 ulp away (a sum added in another order lands
    on the other side of a rounding boundary now and then); float32: within `FLOAT32_RTOL`."""
    assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
    if want.dtype == torch.bfloat16:
        assert (got == want).float().mean() >= 0.99
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-30)
    else:
        torch.testing.assert_close(got, want, rtol=FLOAT32_RTOL, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("width", [576, 40, 21])
def test_rms_norm_is_llamas(dtype, width, vector_build):
    norm = modeling_llama.LlamaRMSNorm(width, eps=1e-5)
    norm.weight.data = torch.randn(width, generator=torch.Generator().manual_seed(width)) * 0.5 + 1
    norm = norm.to(dtype)
    x = strided(9, width, dtype, seed=width, scale=3.0)
    assert_torchs_within_rounding(layer_ops.rms_norm(x, norm.weight, norm.variance_epsilon), norm(x))


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 2, 40), (2, 1, 6)])
def test_rotate_is_llamas_apply_rotary_pos_emb_bit_for_bit(dtype, heads, kv_heads, dim, vector_build):
    rows = 7
    config = modeling_llama.LlamaConfig(hidden_size=heads * dim, num_attention_heads=heads, head_dim=dim)
    cos, sin = modeling_llama.LlamaRotaryEmbedding(config)(torch.zeros(1, rows, dtype=dtype), torch.arange(rows)[None])
    qkv = strided(rows, (heads + 2 * kv_heads) * dim, dtype, seed=dim, scale=2.0)
    q = qkv[:, : heads * dim].view(rows, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(rows, kv_heads, dim)
    want = modeling_llama.apply_rotary_pos_emb(q, k, cos[0], sin[0], unsqueeze_dim=1)
    got = layer_ops.rotate(q, k, cos[0], sin[0])
    for a, b in zip(got, want, strict=True):
        assert a.is_contiguous() and torch.equal(a, b)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_a_nan_stays_a_nan(dtype):
    x = strided(2, 24, dtype, seed=0)
    x[1, 5] = float("nan")
    out = layer_ops.rms_norm(x, torch.ones(24, dtype=dtype), 1e-6)
    assert out[1].isnan().all() and not out[0].isnan().any()
    q = strided(2, 2 * 8, dtype, seed=1).view(2, 2, 8)
    q[0, 1, 2] = float("nan")  # rotates into positions 2 and 6 of its head
    rotated, _ = layer_ops.rotate(q, q[:, :1], torch.ones(2, 8, dtype=dtype), torch.ones(2, 8, dtype=dtype))
    assert rotated.isnan().nonzero().tolist() == [[0, 1, 2], [0, 1, 6]]


@needs_kernel
def test_the_probes_take_llamas_operations_and_refuse_other_formulas():
    bf16 = torch.bfloat16
    llama_norm = modeling_llama.LlamaRMSNorm(32).to(bf16)
    gemma_norm = GemmaRMSNorm(32).to(bf16)  # weight * (1 + w): all zeros here, so w alone would give 0
    assert layer_ops.norm_for(llama_norm, 32, bf16) is not None
    assert layer_ops.norm_for(gemma_norm, 32, bf16) is None
    assert layer_ops.norm_for(torch.nn.LayerNorm(32).to(bf16), 32, bf16) is None  # centred, with a bias
    assert layer_ops.norm_for(llama_norm.half(), 32, torch.float16) is None  # a dtype the kernels do not take
    cos, sin = torch.rand(3, 16).to(bf16), torch.rand(3, 16).to(bf16)
    rope = modeling_llama.apply_rotary_pos_emb
    assert layer_ops.rotation_for(rope, cos, sin, 4, 2, head_dim=16) is layer_ops.rotate
    assert layer_ops.rotation_for(rope, cos[:, :8], sin[:, :8], 4, 2, head_dim=16) is None  # part of each head

    def interleaved(q, k, cos, sin, unsqueeze_dim=1):  # pairs (0, 1), (2, 3), ... as Cohere rotates
        def turn(x):
            return torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).flatten(-2)

        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * cos + turn(q) * sin, k * cos + turn(k) * sin

    assert layer_ops.rotation_for(interleaved, cos, sin, 4, 2, head_dim=16) is None


@needs_kernel
def test_the_decoder_fuses_what_matches_each_family_and_keeps_the_rest():
    llama = SlotDecoder(zoo_model("llama", dtype=torch.bfloat16).eval())
    layer = llama._layers[0]
    assert llama._rotate is layer_ops.rotate
    assert not isinstance(layer.pre_attention, torch.nn.Module) and not isinstance(layer.pre_mlp, torch.nn.Module)
    gemma = SlotDecoder(zoo_model("gemma").eval())
    assert isinstance(gemma._layers[0].pre_attention, torch.nn.Module)  # 1 + weight: its own norm
    cohere = SlotDecoder(zoo_model("cohere").eval())
    assert cohere._rotate is not layer_ops.rotate  # interleaved pairs
    phi3 = SlotDecoder(zoo_model("phi3", partial_rotary_factor=0.5).eval())
    assert phi3._rotate is not layer_ops.rotate  # half of each head rotated


def test_bad_inputs_are_refused_naming_them():
    if not layer_ops.available():
        pytest.skip(f"{layer_ops.unavailable_reason()}")
    with pytest.raises(ValueError, match=r"torch.float16.*Call the model's own operation"):
        layer_ops.rms_norm(torch.zeros(2, 8, dtype=torch.float16), torch.ones(8, dtype=torch.float16), 1e-6)
    q, k = torch.zeros(3, 4, 8), torch.zeros(3, 2, 8)
    with pytest.raises(ValueError, match=r"cos and sin \(rows, dim\); got .*\(3, 4\)"):
        layer_ops.rotate(q, k, torch.zeros(3, 4), torch.zeros(3, 4))
    with pytest.raises(ValueError, match="contiguous heads"):
        layer_ops.rotate(torch.zeros(3, 8, 8)[:, ::2], k, torch.zeros(3, 8), torch.zeros(3, 8))  # heads 16 apart


def test_switched_off_nothing_is_fused(fresh_kernel_state):
    fresh_kernel_state.setenv(layer_ops.ENV_SWITCH, "0")
    assert not layer_ops.available() and layer_ops.unavailable_reason() == f"{layer_ops.ENV_SWITCH}=0"
    with pytest.raises(RuntimeError, match="cannot run here: LIGHTNING_GRPO_LAYER_OPS=0"):
        layer_ops.rms_norm(torch.zeros(1, 8), torch.zeros(8), 1e-6)
    decoder = SlotDecoder(zoo_model("llama").eval())
    assert isinstance(decoder._layers[0].pre_attention, torch.nn.Module)
    assert decoder._rotate is not layer_ops.rotate
