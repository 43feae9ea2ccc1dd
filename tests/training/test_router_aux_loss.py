"""The MoE load-balancing loss (`router_aux_loss_coef`): the loss adds `coef * aux_loss` of the model's own forward
on both forwards, TRL's coefficient rule (the config's own when None, refused on a dense model), the `aux_loss`
metric, and `output_router_logits` never written into the config."""

from __future__ import annotations

import tempfile

import pytest
import torch
from helpers.model_zoo import zoo_model
from helpers.tiny import micro_batch, shared_prompt_group

from lightning_grpo.models import char_tokenizer
from lightning_grpo.training.attention import tree_model_kwargs
from lightning_grpo.training.loss import LossContext, LossOptions, micro_batch_loss
from lightning_grpo.training.padded_forward import padded_forward
from lightning_grpo.training.router_aux_loss import check_router_aux_loss_coef, router_aux_loss_coefficient

MOE_FAMILIES = ["qwen3_moe", "mixtral", "granitemoe", "gpt_oss"]


def moe_batch() -> dict[str, torch.Tensor]:
    samples = shared_prompt_group(5, [3, 4], seed=3) + shared_prompt_group(4, [2, 5], group_id=1, uid0=2, seed=4)
    for sample, advantage in zip(samples, [1.0, -1.0, 0.5, -0.5], strict=True):
        sample["advantage"] = advantage
    return micro_batch(samples)


@pytest.mark.parametrize("packing", ["tree", "padded"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_loss_minus_policy_loss_is_coef_times_the_models_aux_loss(family, packing):
    model, mb, coef = zoo_model(family), moe_batch(), 0.25
    with torch.no_grad():
        policy_only, _, _ = micro_batch_loss(model, mb, LossOptions(), LossContext(packing=packing))
        loss, stats, _ = micro_batch_loss(
            model, mb, LossOptions(), LossContext(packing=packing, router_aux_loss_coef=coef)
        )
        if packing == "tree":
            aux = model(**tree_model_kwargs(mb), output_router_logits=True, use_cache=False).aux_loss
        else:
            aux = padded_forward(model, mb, output_router_logits=True)[1]
    assert aux is not None and aux.item() > 0
    torch.testing.assert_close(loss - policy_only, coef * aux, atol=1e-6, rtol=1e-6)
    metrics = stats.metrics()
    torch.testing.assert_close(torch.tensor(metrics["aux_loss"]), aux, atol=1e-6, rtol=1e-6)
    assert metrics["loss"] == pytest.approx(loss.item(), abs=1e-6)
    assert getattr(model.config, "output_router_logits", False) is not True or family in ("qwen3_moe", "mixtral")


def test_the_aux_loss_is_split_over_the_steps_micro_batches_as_trl_divides_by_accumulation_steps():
    model, mb = zoo_model("qwen3_moe"), moe_batch()
    with torch.no_grad():
        one, _, _ = micro_batch_loss(model, mb, LossOptions(), LossContext(router_aux_loss_coef=0.5))
        four, _, _ = micro_batch_loss(
            model, mb, LossOptions(), LossContext(router_aux_loss_coef=0.5, num_micro_batches=4)
        )
        none, _, _ = micro_batch_loss(model, mb, LossOptions(), LossContext())
    torch.testing.assert_close(four - none, (one - none) / 4)


def test_the_coefficient_follows_trls_rule_on_trls_own_trainer():
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    def trl_coefficient(model, coef):
        args = GRPOConfig(output_dir=tempfile.mkdtemp(), report_to=[], use_cpu=True, router_aux_loss_coef=coef)
        trainer = GRPOTrainer(
            model=model,
            processing_class=char_tokenizer(),
            reward_funcs=[lambda **kwargs: [0.0]],
            args=args,
            train_dataset=Dataset.from_dict({"prompt": ["q"]}),
        )
        return trainer.router_aux_loss_coef if trainer.aux_loss_enabled else 0.0

    for family, coef in [("qwen3_moe", None), ("qwen3_moe", 0.3), ("qwen3_moe", 0.0), ("llama", None)]:
        model = zoo_model(family)
        ours = router_aux_loss_coefficient(model.config, coef)
        assert ours == pytest.approx(trl_coefficient(model, coef)), (family, coef)
    config = zoo_model("qwen3_moe").config
    assert router_aux_loss_coefficient(config, None) == config.router_aux_loss_coef > 0


def test_a_nonzero_coefficient_on_a_dense_model_is_refused_as_trl_refuses_it():
    with pytest.raises(ValueError, match=r"router_aux_loss_coef=0.1.*model_type='llama'.*not a Mixture-of-Experts"):
        check_router_aux_loss_coef(zoo_model("llama"), 0.1)
    with pytest.raises(ValueError, match="not a Mixture-of-Experts"):
        from lightning_grpo import GRPOModule

        GRPOModule("tiny-random", router_aux_loss_coef=0.1)
    check_router_aux_loss_coef(zoo_model("llama"), 0.0)  # 0 and None are fine on any model
    check_router_aux_loss_coef(zoo_model("qwen3_moe"), 0.1)


def test_without_the_option_no_router_logits_are_asked_for():
    calls = []
    model = zoo_model("granitemoe")  # its config does not ask for router logits itself
    model.register_forward_pre_hook(lambda m, a, kw: calls.append(kw.get("output_router_logits")), with_kwargs=True)
    with torch.no_grad():
        micro_batch_loss(model, moe_batch(), LossOptions(), LossContext())
        micro_batch_loss(model, moe_batch(), LossOptions(), LossContext(router_aux_loss_coef=0.1))
    assert calls == [None, True]
    assert not getattr(model.config, "output_router_logits", False)  # a forward argument, never the config
