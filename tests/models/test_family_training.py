"""Every family of the model zoo trains exactly: on the forward `packing="auto"` picks (tree where every layer is
attention over `position_ids`, padded otherwise), the loss terms' log-probabilities, entropies and the policy loss's
gradients equal those of an unpacked per-sample forward; forcing the padded forward on tree families changes nothing;
forcing the tree on a family it is not exact for is refused, and running it anyway gives different log-probabilities
(the comparison can fail). LoRA ("all-linear" and the fused projections by name) wraps every family and trains only
the adapters."""

from __future__ import annotations

import pytest
import torch
from helpers.model_zoo import FAMILIES, zoo_model
from helpers.tiny import micro_batch, reference_logprobs, shared_prompt_group
from peft import LoraConfig

from lightning_grpo.training.attention import tree_model_kwargs, use_tree_attention
from lightning_grpo.training.forward import term_logprobs
from lightning_grpo.training.loss import LossContext, LossOptions, LossTerms, Normalizers, micro_batch_loss, policy_loss
from lightning_grpo.training.packing_choice import choose_packing
from lightning_grpo.training.policy import apply_peft, check_peft_config

#: families the tree forward is not exact for: linear attention, a convolution, a state-space mixer, and a model
#: whose layers drop the attention function's keyword arguments
PADDED_FAMILIES = {"qwen3_5_text", "lfm2", "falcon_h1", "stablelm"}
ADVANTAGES = [1.0, -0.5, 0.3, -1.0, 0.7, 0.2]


def family_samples() -> list[dict]:
    """Two groups, each a prompt with 3 completions of different lengths (forking inside the completions)."""
    samples = shared_prompt_group(6, [3, 5, 2], seed=1) + shared_prompt_group(4, [4, 1, 6], group_id=1, uid0=3, seed=2)
    for sample, advantage in zip(samples, ADVANTAGES, strict=True):
        sample["advantage"] = advantage
    return samples


def per_sample_loss(model: torch.nn.Module, samples: list[dict], mb: dict) -> tuple[torch.Tensor, ...]:
    """The unpacked reference: each sample's own forward, then the same policy loss on its terms."""
    logprobs, entropy = reference_logprobs(model, samples)
    terms = LossTerms(logprobs, mb["old_log_probs"], mb["advantages"], mb["segment_id"])
    loss, _ = policy_loss(terms, LossOptions(), Normalizers(tokens=mb["step_trained_tokens"]))
    return logprobs, entropy, loss


def gradients(model: torch.nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    return {name: g for name, g in zip(params, grads, strict=True) if g is not None}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_auto_forward_matches_the_unpacked_per_sample_forward(family):
    samples = family_samples()
    mb = micro_batch(samples)
    model, reference = zoo_model(family), zoo_model(family)
    path = choose_packing(model, "auto")
    assert path == ("padded" if family in PADDED_FAMILIES else "tree")
    context = LossContext(packing=path)
    ours = term_logprobs(model, mb, packing=path)
    loss, _, _ = micro_batch_loss(model, mb, LossOptions(), context)
    expected_logprobs, expected_entropy, expected_loss = per_sample_loss(reference, samples, mb)
    torch.testing.assert_close(ours.logprobs, expected_logprobs.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.entropy, expected_entropy.detach(), atol=1e-5, rtol=0)
    got, expected = gradients(model, loss), gradients(reference, expected_loss)
    assert got.keys() == expected.keys() and got
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-5, rtol=1e-5, msg=f"{family}: {name}")


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_oss", "qwen3_moe", "gpt2"])
def test_padded_forward_forced_on_a_tree_family_gives_the_tree_logprobs(family):
    mb = micro_batch(family_samples())
    with torch.no_grad():
        tree = term_logprobs(zoo_model(family), mb, packing=choose_packing(zoo_model(family), "tree"))
        padded = term_logprobs(zoo_model(family), mb, packing=choose_packing(zoo_model(family), "padded"))
    torch.testing.assert_close(padded.logprobs, tree.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", sorted(PADDED_FAMILIES))
def test_tree_forced_on_a_family_it_is_not_exact_for_is_refused_and_would_be_wrong(family):
    model = zoo_model(family)
    model_type = FAMILIES[family][0]
    with pytest.raises(ValueError, match=rf"model_type='{model_type}'.*packing='padded'"):
        choose_packing(model, "tree")
    samples = family_samples()
    mb = micro_batch(samples)
    expected, _ = reference_logprobs(zoo_model(family), samples)
    try:  # the negative control: the tree forward run anyway is not the per-sample forward
        with torch.no_grad():
            logits = use_tree_attention(model)(**tree_model_kwargs(mb), use_cache=False).logits[0]
    except ValueError as error:  # a model whose layers drop the tree arguments cannot even run it
        assert "tree_kv_index" in str(error)
        return
    labels = mb["shift_labels"][mb["token_index"]]
    got = torch.log_softmax(logits[mb["token_index"]], -1).gather(1, labels[:, None]).squeeze(1)
    assert (got - expected.detach()).abs().max().item() > 1e-4


def lora_grads(family: str, target_modules) -> dict[str, torch.Tensor]:
    model = zoo_model(family)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=target_modules)
    check_peft_config(config, model)
    policy = apply_peft(model, config)
    mb = micro_batch(family_samples())
    loss, _, _ = micro_batch_loss(policy, mb, LossOptions(), LossContext(packing=choose_packing(policy, "auto")))
    loss.backward()
    return {name: p.grad for name, p in policy.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_lora_all_linear_wraps_every_family_and_trains_only_the_adapters(family):
    grads = lora_grads(family, "all-linear")
    assert grads and all("lora_" in name for name in grads), sorted(grads)[:5]
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert any(g.abs().sum() > 0 for g in grads.values())


@pytest.mark.parametrize("family, fused", [("phi3", "qkv_proj"), ("gpt_neox", "query_key_value"), ("gpt2", "c_attn")])
def test_lora_on_a_fused_attention_projection_by_name(family, fused):
    grads = lora_grads(family, [fused])
    assert grads and all(f"{fused}.lora_" in name for name in grads)
    assert any(g.abs().sum() > 0 for g in grads.values())
