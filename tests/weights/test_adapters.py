"""What a generator receives from a LoRA policy (weights/adapters.py, parameters.py, WeightSync): merged weights equal
to PEFT's own merge under the base model's names, computed without touching the trained copy; after the first push
only the adapted layers move, and the embedded generator then samples with the LoRA policy's exact distribution.
Real PEFT, the real tiny model, the real shared-memory transfer and embedded generator."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from helpers.lora import lora_policy, nudge_adapters
from helpers.model_zoo import zoo_model
from peft import LoraConfig

from lightning_grpo._trl import iter_vllm_named_params
from lightning_grpo.models import tiny_llama
from lightning_grpo.rollout.generator import EmbeddedGenerator, PolicySpec
from lightning_grpo.rollout.sampling import teacher_forced_logprobs
from lightning_grpo.training.policy import apply_peft
from lightning_grpo.weights.adapters import adapter_tensors
from lightning_grpo.weights.factory import nccl_manifest
from lightning_grpo.weights.parameters import changed_names, generator_parameters
from lightning_grpo.weights.shared_memory import SharedMemoryWeightTransfer
from lightning_grpo.weights.sync import WeightSync

PROMPT = [2, 40, 41, 42, 43]
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def snapshot(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in policy.named_parameters()}


@pytest.mark.parametrize(
    "options",
    [dict(target_modules=["q_proj", "v_proj"]), dict(target_modules="all-linear", use_dora=True)],
    ids=["lora", "dora"],
)
def test_merged_stream_equals_peft_merge_under_base_names_and_leaves_the_policy_as_it_was(options):
    torch.manual_seed(0)
    policy = apply_peft(tiny_llama(0), LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **options))
    nudge_adapters(policy)
    before = snapshot(policy)
    streamed = dict(generator_parameters(policy))
    expected = dict(copy.deepcopy(policy).merge_and_unload().named_parameters())
    assert list(streamed) == list(expected)  # the base model's names, in its order; the tied head once
    for name, tensor in expected.items():
        torch.testing.assert_close(streamed[name], tensor, rtol=0, atol=1e-6, msg=name)
    assert not torch.equal(
        streamed["model.layers.0.self_attn.q_proj.weight"], tiny_llama(0).model.layers[0].self_attn.q_proj.weight
    )
    after = snapshot(policy)
    assert all(torch.equal(after[name], before[name]) for name in before)  # nothing was merged into the trained copy
    assert not any(layer.merged for layer in policy.modules() if hasattr(layer, "merged_adapters"))
    # TRL's NCCL manifest (its names for a PEFT model) is what the merged stream sends, in order
    trl_names = [name for name, _ in iter_vllm_named_params(policy)]
    assert nccl_manifest(policy)["names"] == trl_names == list(streamed)
    manifest_stream = dict(generator_parameters(policy, trainable_only=True))  # for NCCL: the same merged tensors
    assert list(manifest_stream) == list(streamed)
    assert all(torch.equal(manifest_stream[name], tensor) for name, tensor in streamed.items())


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "phi3", "gpt2"])
def test_merged_stream_equals_peft_merge_on_experts_and_fused_projections(family):
    """All-linear LoRA on a mixture of experts (PEFT wraps the stacked expert weights as parameters) and on fused or
    Conv1D projections: every streamed tensor equals PEFT's own merge."""
    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules="all-linear")
    policy = apply_peft(zoo_model(family), config)
    streamed = dict(generator_parameters(policy))
    expected = dict(copy.deepcopy(policy).merge_and_unload().named_parameters())
    assert list(streamed) == list(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(streamed[name], tensor, rtol=0, atol=1e-6, msg=name)
    base = dict(zoo_model(family).named_parameters())
    assert any(
        not torch.equal(streamed[name], base[name])
        for name in streamed
        if "expert" in name or "c_attn" in name or "qkv" in name
    )


def test_changed_names_are_the_adapted_layers_or_their_whole_modules():
    policy = lora_policy()
    assert changed_names(policy) == {
        f"model.layers.{i}.self_attn.{p}.weight" for i in (0, 1) for p in ("q_proj", "v_proj")
    }
    assert changed_names(policy, scope="modules") == {
        f"model.layers.{i}.self_attn.{p}.weight" for i in (0, 1) for p in ATTENTION
    }
    full = tiny_llama(0)
    full.model.embed_tokens.weight.requires_grad_(False)
    assert "model.embed_tokens.weight" not in changed_names(full)
    assert len(changed_names(full)) == len(list(full.parameters())) - 1
    adapter = dict(adapter_tensors(policy))
    assert set(adapter) == {
        f"base_model.model.model.layers.{i}.self_attn.{p}.lora_{m}.weight"
        for i in (0, 1) for p in ("q_proj", "v_proj") for m in "AB"
    }  # fmt: skip


def test_embedded_generator_samples_with_the_lora_policy_after_a_full_then_partial_pushes():
    policy = lora_policy()
    sync = WeightSync(SharedMemoryWeightTransfer, changed_only="tensors")
    generator = None
    try:
        sync.push(policy)  # the first push of a run is whole: the generator was built without weights
        full_bytes = sync.last_push_bytes
        generator = EmbeddedGenerator(
            PolicySpec.from_model(policy), eos_token_ids=[], max_tokens=8, weight_receiver=sync.receiver()
        )
        first = asyncio.run(generator.generate(PROMPT))
        assert first.model_version == 0
        # A layer the adapters do not touch is not sent again: spoil the generator's copy, it must stay spoiled.
        untouched = generator.model.model.layers[0].self_attn.k_proj.weight
        with torch.no_grad():
            untouched.mul_(0.0)
        nudge_adapters(policy)
        sync.push(policy)
        assert sync.last_push_bytes < 0.2 * full_bytes  # 4 of 2 layers x 4 attention weights, no MLP, no embedding
        assert asyncio.run(generator.generate(PROMPT)).model_version == 1  # the generator applied the push
        assert not untouched.any()
        with torch.no_grad():
            untouched.copy_(tiny_llama(0).model.layers[0].self_attn.k_proj.weight)
        output = asyncio.run(generator.generate(PROMPT))
        expected = teacher_forced_logprobs(policy, PROMPT, output.token_ids)
        assert (expected - torch.tensor(output.logprobs)).abs().max() <= 1e-4
        assert (
            teacher_forced_logprobs(policy, PROMPT, first.token_ids) - torch.tensor(first.logprobs)
        ).abs().max() > 1e-3
    finally:
        if generator is not None:
            generator.close()
        sync.close()


def test_a_partial_send_before_any_full_one_is_refused():
    policy = lora_policy()
    transfer = SharedMemoryWeightTransfer(policy)
    try:
        names = changed_names(policy)
        with pytest.raises(ValueError, match=r"partial=True\)` before a full send"):
            transfer.send_weights(generator_parameters(policy, names=names), version=0, partial=True)
        transfer.resume()
    finally:
        transfer.destroy()


@pytest.mark.parametrize("family", ["llama", "gemma", "qwen3_moe", "mixtral", "gpt_oss"])
def test_a_vllm_push_names_and_lays_out_tensors_as_the_checkpoint_does(family, tmp_path):
    """What `VLLMHTTPWeightTransfer` writes for the server is what `save_pretrained` writes: a mixture of experts'
    stacked expert weights as one tensor per expert and projection (the names vLLM's loader knows), a tied head once."""
    from safetensors.torch import load_file

    from lightning_grpo.weights.vllm_http import _unique_tensors, checkpoint_format

    model = zoo_model(family)
    pushed = checkpoint_format(model, _unique_tensors(model.named_parameters()))
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    assert sorted(pushed) == sorted(saved)
    assert all(torch.equal(pushed[name], saved[name]) for name in saved)
    if family in ("qwen3_moe", "mixtral"):
        assert "model.layers.0.mlp.experts.gate_up_proj" not in pushed
