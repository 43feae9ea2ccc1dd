"""The policy as it trains (lightning_grpo/training/policy.py): a LoRA config checked at construction, only adapters in the
optimizer, activation checkpointing that gives the same gradients through tree attention, bf16 with float32
log-probabilities. Real PEFT, the real tiny model, Lightning's own precision plugins."""

from __future__ import annotations

import pytest
import torch
from helpers.lora import LORA, lora_policy
from helpers.tiny import micro_batch, shared_prompt_group
from peft import IA3Config, LoraConfig

from lightning_grpo.models import tiny_llama
from lightning_grpo.models.lora import is_peft_model
from lightning_grpo.module import GRPOModule
from lightning_grpo.training.loss import grpo_loss, packed_logprobs
from lightning_grpo.training.policy import enable_activation_checkpointing

TINY_LAYERS = "embed_tokens, q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, lm_head"


def packed_step() -> dict[str, torch.Tensor]:
    """Two groups sharing their prompts in one tree-packed row, with advantages."""
    samples = shared_prompt_group(9, [6, 4, 8], seed=4) + shared_prompt_group(5, [7, 7], group_id=1, uid0=3, seed=5)
    for i, s in enumerate(samples):
        s["advantage"] = (-1.0) ** i * (0.5 + i / 10)
    return micro_batch(samples)


def step_loss(policy: torch.nn.Module, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    logprobs, _ = packed_logprobs(policy, mb, temperature=0.8)
    loss, _ = grpo_loss(logprobs, mb["old_log_probs"], mb["advantages"], normalizer=mb["step_trained_tokens"])
    return loss, logprobs


@pytest.mark.parametrize("policy", ["tiny-random", "module"])
def test_a_peft_config_whose_target_modules_do_not_exist_fails_at_construction_naming_the_modules(policy):
    model = tiny_llama(0) if policy == "module" else policy
    with pytest.raises(ValueError) as error:
        GRPOModule(model, peft_config=LoraConfig(target_modules=["qkv_proj", "mlp.fc1"]))
    message = str(error.value)
    assert "target_modules=['mlp.fc1', 'qkv_proj']" in message and TINY_LAYERS in message
    if policy == "module":
        assert not any("lora" in name for name, _ in model.named_modules())  # the user's model is left as it was
    with pytest.raises(TypeError, match=r"GRPOModule\(peft_config=IA3Config\(\.\.\.\)\).*peft\.LoraConfig"):
        GRPOModule("tiny-random", peft_config=IA3Config(target_modules=["k_proj"]))


def test_only_the_adapters_train_and_are_in_the_optimizer():
    module = GRPOModule("tiny-random", peft_config=LoraConfig(**LORA))
    module.configure_model()
    assert is_peft_model(module.policy) and module.strict_loading is False
    trainable = {name for name, param in module.policy.named_parameters() if param.requires_grad}
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    optimized = {id(p) for group in module.configure_optimizers()["optimizer"].param_groups for p in group["params"]}
    assert optimized == {id(p) for p in module.policy.parameters() if p.requires_grad}
    module.configure_model()  # a second call (fit after validate) does not wrap the policy again
    assert sum(".lora_A." in name for name, _ in module.policy.named_parameters()) == 4
    peft_model = lora_policy()
    given = GRPOModule(peft_model)  # a PEFT model passed in: its adapters train, checkpoints keep only them
    given.configure_model()
    assert given.policy is peft_model and given.peft_config.r == 8 and given.strict_loading is False


@pytest.mark.parametrize("with_lora", [False, True], ids=["full", "lora"])
def test_gradient_checkpointing_gives_the_gradients_of_the_plain_forward_through_tree_attention(with_lora):
    plain, checkpointed = (lora_policy() if with_lora else tiny_llama(0) for _ in range(2))
    enable_activation_checkpointing(checkpointed)
    mb = packed_step()
    calls = []
    attention = next(m for name, m in checkpointed.named_modules() if name.endswith("layers.0.self_attn"))
    attention.register_forward_hook(lambda *args: calls.append(1))
    grads = []
    for policy in (plain, checkpointed):
        policy.train()
        loss, _ = step_loss(policy, mb)
        loss.backward()
        grads.append({n: p.grad for n, p in policy.named_parameters() if p.requires_grad})
    assert len(calls) == 2  # the layer ran again in the backward: checkpointing was on
    assert grads[0].keys() == grads[1].keys()
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=0, atol=1e-7, msg=name)


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bf16_precision_keeps_the_logprobs_and_the_loss_float32_and_close_to_fp32(precision):
    from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision

    plugin = MixedPrecision(precision, "cpu") if precision == "bf16-mixed" else HalfPrecision(precision)
    mb = packed_step()
    _, reference = step_loss(lora_policy(), mb)
    policy = plugin.convert_module(lora_policy())
    with plugin.forward_context():
        loss, logprobs = step_loss(policy, mb)
    loss.backward()
    assert logprobs.dtype == loss.dtype == torch.float32
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in policy.parameters() if p.requires_grad)
    assert (logprobs.detach() - reference.detach()).abs().max() < 0.1  # bf16 matmuls, float32 log-softmax


def test_a_lora_policys_reference_is_the_policy_with_adapters_disabled_and_a_trained_adapter_gets_a_frozen_copy():
    """GRPOTrainer under PEFT: the KL reference of fresh (zero) adapters is the base model, computed by disabling the
    adapters of the trained policy itself (no second copy of the weights); a PEFT model passed in with non-zero
    adapters keeps those adapters in its reference (a frozen copy of the initial policy)."""
    from lightning_grpo.training.loss import LossContext
    from lightning_grpo.training.reference import DisabledAdaptersReference, ReferenceModel

    mb = packed_step()
    context = LossContext(temperature=0.8)
    base_logprobs, _ = packed_logprobs(tiny_llama(0), mb, temperature=0.8)
    module = GRPOModule("tiny-random", peft_config=LoraConfig(**LORA), beta=0.04)
    module.configure_model()
    assert isinstance(module.reference, DisabledAdaptersReference) and module.reference.policy is module.policy
    with torch.no_grad():
        for name, param in module.policy.named_parameters():
            if ".lora_B." in name:
                param.normal_()  # as if the adapters had trained
    trained, _ = packed_logprobs(module.policy, mb, temperature=0.8)
    assert (trained - base_logprobs).abs().max() > 1e-3
    torch.testing.assert_close(module.reference.logprobs(mb, context), base_logprobs, rtol=0, atol=1e-6)
    assert module.policy.active_adapters == ["default"]  # enabled again after the reference's forward

    given = GRPOModule(lora_policy(), beta=0.04)
    given.configure_model()
    assert isinstance(given.reference, ReferenceModel)
    initial, _ = packed_logprobs(lora_policy(), mb, temperature=0.8)
    torch.testing.assert_close(given.reference.logprobs(mb, context), initial, rtol=0, atol=1e-6)
    assert (initial - base_logprobs).abs().max() > 1e-3


def test_tr_dpo_with_lora_is_refused_at_construction_with_the_fix():
    with pytest.raises(ValueError, match=r"sync_ref_model=True\).*peft_config.*sync_ref_model=False"):
        GRPOModule("tiny-random", peft_config=LoraConfig(**LORA), beta=0.04, sync_ref_model=True)
