"""GRPODataModule options that fail at construction, before `Trainer.fit` starts ranks or the rollout child."""

from __future__ import annotations

import pytest

from lightning_grpo import GRPODataModule
from lightning_grpo.rollout.loop import GRPORolloutLoop


class NotALoop:
    pass


class MyLoop(GRPORolloutLoop):
    pass


@pytest.mark.parametrize(
    ("loop_cls", "named"),
    [
        ("no_such_pkg.loops.MyLoop", "no_such_pkg.loops.MyLoop"),
        ("test_datamodule.NotALoop", "is not a subclass of lightning_grpo.GRPORolloutLoop"),
        (NotALoop, "NotALoop"),
    ],
    ids=["not_importable", "path_to_other_class", "other_class"],
)
def test_a_loop_cls_that_is_not_a_rollout_loop_is_named(loop_cls, named):
    with pytest.raises(ValueError, match="loop_cls") as error:
        GRPODataModule(model="tiny-random", loop_cls=loop_cls)
    assert named in str(error.value)


def test_loop_cls_by_import_path_or_class():
    assert GRPODataModule(model="tiny-random", loop_cls="test_datamodule.MyLoop").loop_cls is MyLoop
    assert GRPODataModule(model="tiny-random", loop_cls=MyLoop).loop_cls is MyLoop
    assert GRPODataModule(model="tiny-random").loop_cls is None


def test_loop_kwargs_may_not_override_the_data_modules_own_options():
    with pytest.raises(ValueError, match=r"\['seed', 'temperature'\].*set them there"):
        GRPODataModule(model="tiny-random", loop_kwargs={"temperature": 0.1, "seed": 3, "tag": "mine"})
    assert GRPODataModule(model="tiny-random", loop_kwargs={"tag": "mine"}).loop_kwargs == {"tag": "mine"}


def test_bad_generation_options_are_reported_together_with_their_values():
    with pytest.raises(ValueError, match=r"min_p=1.5.*repetition_penalty=0.*stop='</s>' is a string.*stop=\['</s>'\]"):
        GRPODataModule(model="tiny-random", min_p=1.5, repetition_penalty=0.0, stop="</s>")
    with pytest.raises(ValueError, match="stop has 5 strings, but a vLLM server takes at most 4"):
        GRPODataModule(model="tiny-random", generator="vllm", stop=list("abcde"))
    assert GRPODataModule(model="tiny-random", stop=list("abcde"), min_p=0.1).hparams.stop == list("abcde")
    with pytest.raises(ValueError, match=r"generator_dtype='fp16' \(one of 'auto', 'float32', 'bfloat16', or None"):
        GRPODataModule(model="tiny-random", generator_dtype="fp16")
    with pytest.raises(ValueError, match=r"generator_dtype='bfloat16' with generator='vllm'.*its own `--dtype`"):
        GRPODataModule(model="tiny-random", generator="vllm", generator_dtype="bfloat16")
    # the default, "auto", leaves a vLLM server's dtype to the server
    assert GRPODataModule(model="tiny-random").hparams.generator_dtype == "auto"
    assert GRPODataModule(model="tiny-random", generator="vllm").hparams.generator_dtype == "auto"


def test_int8_generator_weights_reach_the_generator_spec_and_bad_values_are_named():
    from lightning_grpo.models import tiny_llama
    from lightning_grpo.pipeline.session import embedded_generator_spec

    with pytest.raises(ValueError, match=r"generator_quantization='int4' \(one of 'int8', or None: none\)"):
        GRPODataModule(model="tiny-random", generator_quantization="int4")
    with pytest.raises(ValueError, match=r"generator_quantization='int8' with generator='vllm'.*own `--quantization`"):
        GRPODataModule(model="tiny-random", generator="vllm", generator_quantization="int8")
    options = GRPODataModule(model="tiny-random", generator_quantization="int8").options
    spec = embedded_generator_spec(options, tiny_llama(), [3], tokenizer=None, weight_receiver=None)
    assert spec.options["quantization"] == "int8"
    plain = GRPODataModule(model="tiny-random").options
    assert embedded_generator_spec(plain, tiny_llama(), [3], None, None).options["quantization"] is None


def test_a_group_that_can_never_fit_a_step_fails_at_set_up_naming_the_knob(no_leaked_processes):
    """8 completions in rows of 2 samples, 1 micro-batch on 1 process: no step can hold a group. The fit fails in
    `setup`, before anything is spawned, instead of dropping every group as oversize until the run stalls."""
    from helpers.tiny import cpu_trainer, tiny_datamodule

    from lightning_grpo import GRPOModule

    datamodule = tiny_datamodule(4, num_generations=8, samples_per_row=2)
    with pytest.raises(
        ValueError, match=r"A group of 8 samples needs 4 rows of samples_per_row=2.*Raise samples_per_row"
    ):
        cpu_trainer().fit(GRPOModule("tiny-random"), datamodule=datamodule)
    assert datamodule.rollout_worker is None


def test_grpo_module_without_a_rollout_data_module_says_what_it_needs():
    from helpers.tiny import cpu_trainer
    from torch.utils.data import DataLoader

    from lightning_grpo import GRPOModule

    with pytest.raises(TypeError, match=r"trains on a GRPODataModule.*but got no data module.*temperature"):
        cpu_trainer().fit(GRPOModule("tiny-random"), train_dataloaders=DataLoader([1, 2]))


def test_the_contract_is_read_from_the_data_modules_options():
    datamodule = GRPODataModule(
        model="tiny-random",
        temperature=0.7,
        top_k=5,
        reward_weights=[2.0],
        scale_rewards="none",
        max_completion_length=9,
    )
    datamodule.setup("validate")
    contract = datamodule.rollout_contract()
    assert (contract.temperature, contract.top_k, contract.max_completion_length) == (0.7, 5, 9)
    assert contract.reward_names == ("accuracy",) and contract.reward_weights == (2.0,)
    assert contract.scale_rewards == "none" and contract.tokenizer is datamodule.tokenizer
    with pytest.raises(RuntimeError, match="once `setup` ran"):
        GRPODataModule(model="tiny-random").rollout_contract()


@pytest.mark.parametrize("other", [{"drop_no_signal_groups": False}, {"replace_dropped_groups": False}])
def test_replace_early_without_dropping_and_replacing_is_refused_naming_both_switches(other):
    with pytest.raises(ValueError, match=r"replace_early=True with drop_no_signal_groups=.*set both True"):
        GRPODataModule(model="tiny-random", replace_early=True, **other)
    assert GRPODataModule(model="tiny-random", replace_early=True).options.steps.replace_early
    assert not GRPODataModule(model="tiny-random", **other).options.steps.replace_early
