"""`GRPOModule(torch_compile=True)`: each decoder layer compiled with inductor (real `torch.compile`, real C++ build)
trains as the eager layers do, reuses one graph across packed rows of changing length, and a real fit with it trains,
validates eagerly and checkpoints the same keys. The options follow TRL's (transformers' `TrainingArguments`) rule,
checked by running TRL's own `GRPOConfig`."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
from helpers.tiny import cpu_trainer, micro_batch, shared_prompt_group, tiny_datamodule, tiny_prompts
from torch._dynamo.utils import counters

from lightning_grpo import GRPOModule
from lightning_grpo.models import tiny_llama
from lightning_grpo.training.attention import use_tree_attention
from lightning_grpo.training.compilation import CompileOptions, compile_policy, decoder_layers
from lightning_grpo.training.loss import grpo_loss, packed_logprobs

pytestmark = pytest.mark.timeout(600)


def _rows() -> list[dict]:
    """Packed rows of 3 different token counts (one group each, then two groups: two segment batches)."""
    one = micro_batch(shared_prompt_group(9, [5, 7, 3, 6], seed=1))
    other = micro_batch(shared_prompt_group(11, [8, 2, 9, 4], seed=2))
    two = micro_batch(
        shared_prompt_group(6, [3, 4], seed=3) + shared_prompt_group(13, [5, 1], group_id=1, uid0=2, seed=4)
    )
    assert len({row["input_ids"].numel() for row in (one, other, two)}) == 3
    return [one, other, two]


def _fresh_compiles() -> None:
    """Forget what this process compiled (another test may have compiled the same layer code) and the counts."""
    torch.compiler.reset()
    counters.clear()


def _loss_and_grads(policy: torch.nn.Module, row: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    logprobs, _ = packed_logprobs(policy, row)
    loss, _ = grpo_loss(logprobs, row["old_log_probs"], row["advantages"], normalizer=row["token_index"].numel())
    loss.backward()
    grads = [p.grad.clone() for p in policy.parameters()]
    policy.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize(
    ("autocast", "tolerance"),
    [(False, 1e-5), (True, 3e-2)],  # bf16: the compiled graph rounds in other places than the eager ops
    ids=["fp32", "bf16-mixed"],
)
def test_compiled_layers_train_as_the_eager_ones_and_reuse_one_graph_across_row_lengths(autocast, tolerance):
    eager = use_tree_attention(tiny_llama(0)).train()
    compiled = copy.deepcopy(eager)
    assert compile_policy(compiled, CompileOptions(enabled=True)) == len(decoder_layers(eager)) == 2
    forwards = [layer.forward for layer in decoder_layers(compiled)]
    compile_policy(compiled, CompileOptions(enabled=True))  # again (a second fit): the compiled forwards are kept
    assert [layer.forward for layer in decoder_layers(compiled)] == forwards
    _fresh_compiles()
    graphs = []
    for row in _rows():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            expected_loss, expected_grads = _loss_and_grads(eager, row)
            loss, grads = _loss_and_grads(compiled, row)
        torch.testing.assert_close(loss, expected_loss, atol=tolerance, rtol=tolerance)
        for grad, expected in zip(grads, expected_grads, strict=True):
            torch.testing.assert_close(grad, expected, atol=tolerance, rtol=tolerance)
        graphs.append(counters["stats"]["unique_graphs"])
    # the layers really ran compiled, and the later rows (other lengths, another segment layout: the attention runs
    # eagerly between the compiled parts) reused the first row's graphs
    assert graphs[0] > 0 and graphs[1:] == [graphs[0]] * 2, graphs


def test_options_turn_on_and_default_as_trls_grpo_config(tmp_path):
    from trl import GRPOConfig

    for flag, backend, mode in [(False, None, None), (True, None, None), (False, None, "max-autotune")]:
        trl = GRPOConfig(
            output_dir=str(tmp_path),
            use_cpu=True,
            torch_compile=flag,
            torch_compile_backend=backend,
            torch_compile_mode=mode,
        )
        ours = CompileOptions.resolve(flag, backend, mode)
        assert ours.enabled == trl.torch_compile
        assert ours.mode == trl.torch_compile_mode
        if trl.torch_compile:
            assert ours.backend == trl.torch_compile_backend == "inductor"


def test_bad_options_are_refused_by_name_with_the_known_values():
    with pytest.raises(ValueError, match=r"torch_compile_backend='nope'.*'inductor'"):
        GRPOModule("tiny-random", torch_compile_backend="nope")
    with pytest.raises(ValueError, match=r"torch_compile_mode='fastest'.*'max-autotune'"):
        GRPOModule("tiny-random", torch_compile_mode="fastest")


def test_a_policy_without_decoder_layers_is_refused_naming_its_class():
    with pytest.raises(ValueError, match=r"Sequential lists no decoder layer classes"):
        compile_policy(torch.nn.Sequential(torch.nn.Linear(2, 2)), CompileOptions(enabled=True))


def test_inductor_on_cpu_without_a_cpp_compiler_is_refused_before_the_first_step():
    from torch._inductor import config

    policy = tiny_llama(0)
    refused = pytest.raises(RuntimeError, match=r"needs a C\+\+ compiler.*no-such-compiler-here.*`CXX`")
    with config.patch({"cpp.cxx": ("no-such-compiler-here",)}), refused:
        compile_policy(policy, CompileOptions(enabled=True))
    assert compile_policy(policy, CompileOptions(enabled=False)) == 0  # off: nothing checked, nothing compiled


class _GraphsAroundValidation(pl.Callback):
    """The count of compiled graphs when validation starts and when it ends."""

    def __init__(self) -> None:
        self.at_start: list[int] = []
        self.at_end: list[int] = []

    def on_validation_start(self, trainer, pl_module) -> None:
        self.at_start.append(counters["stats"]["unique_graphs"])

    def on_validation_end(self, trainer, pl_module) -> None:
        self.at_end.append(counters["stats"]["unique_graphs"])


@pytest.mark.usefixtures("no_leaked_processes")
def test_a_fit_with_compiled_layers_trains_validates_eagerly_and_checkpoints_the_same_keys():
    module = GRPOModule("tiny-random", learning_rate=1e-3, torch_compile=True)
    data = tiny_datamodule(4, val_dataset=tiny_prompts(2), val_size=2, val_batch_size=2)
    initial = tiny_llama(0).state_dict()
    graphs = _GraphsAroundValidation()
    _fresh_compiles()
    trainer = cpu_trainer(limit_val_batches=None, callbacks=[graphs])
    trainer.fit(module, datamodule=data)  # one epoch of the 4 prompts, then the end-of-fit validation
    assert trainer.global_step > 0
    assert "val/reward" in trainer.callback_metrics  # the end-of-fit validation ran
    assert graphs.at_start and graphs.at_start[-1] > 0  # training ran through compiled layers
    assert graphs.at_end == graphs.at_start  # validation's `generate` compiled nothing
    state = module.policy.state_dict()
    assert state.keys() == initial.keys()  # the checkpoint's names are the plain model's
    assert any(not torch.equal(state[name], initial[name]) for name in initial)  # it trained
