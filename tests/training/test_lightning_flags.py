"""Lightning's `Trainer(accumulate_grad_batches=...)` and `Trainer(gradient_clip_val=...)` with `GRPOModule` (manual
optimization): mapped onto `GRPODataModule(gradient_accumulation_steps)` and `GRPOModule(max_grad_norm)` in a real
`Trainer.fit`, or refused with one `ValueError` naming our option (never Lightning's own exception)."""

from __future__ import annotations

import pytest
from helpers.optimizer_probe import OptimizerStepProbe
from helpers.replay import fit_replay, replay_steps
from helpers.tiny import cpu_trainer, tiny_datamodule

from lightning_grpo.module import GRPOModule
from lightning_grpo.training.lightning_flags import map_lightning_flags


def mapped(command_line: bool = False, **flags) -> tuple[int, float | None]:
    options = dict(
        accumulate_grad_batches=1,
        gradient_clip_val=None,
        gradient_clip_algorithm=None,
        gradient_accumulation_steps=1,
        max_grad_norm=1.0,
    )
    return map_lightning_flags(**(options | flags), command_line=command_line)


@pytest.mark.timeout(240)
def test_trainer_accumulate_grad_batches_trains_that_many_micro_batches_per_optimizer_step(no_leaked_processes):
    """4 groups of one row each: 2 optimizer steps of 2 micro-batches (1 per step without the flag would be 4)."""
    datamodule = tiny_datamodule(4)
    probe = OptimizerStepProbe()
    trainer = cpu_trainer(accumulate_grad_batches=2, callbacks=[probe])
    trainer.fit(GRPOModule("tiny-random", learning_rate=1e-3), datamodule=datamodule)
    assert datamodule.hparams.gradient_accumulation_steps == 2 and trainer.accumulate_grad_batches == 1
    assert probe.micro_batches == [2, 2] and trainer.global_step == 2
    assert datamodule.progress.trained_total + sum(datamodule.progress.dropped.values()) == 4


def test_trainer_gradient_clip_val_clips_the_gradient_norm_to_it():
    probe = OptimizerStepProbe()
    module = GRPOModule("tiny-random", learning_rate=1e-3)
    trainer_options = dict(gradient_clip_val=1e-3, gradient_clip_algorithm="norm", callbacks=[probe])
    fit_replay(module, replay_steps(2), **trainer_options)
    assert module.hparams.max_grad_norm == 1e-3 and module.trainer.gradient_clip_val is None
    assert probe.gradient_norms == pytest.approx([1e-3, 1e-3], rel=1e-3)


def test_trainer_gradient_clip_val_0_turns_clipping_off():
    probe = OptimizerStepProbe()
    module = GRPOModule("tiny-random", learning_rate=1e-3, max_grad_norm=1e-3)
    with pytest.raises(ValueError, match=r"`Trainer\(gradient_clip_val=0\)` and `GRPOModule\(max_grad_norm=0.001\)`"):
        fit_replay(module, replay_steps(1), gradient_clip_val=0)
    module = GRPOModule("tiny-random", learning_rate=1e-3)
    fit_replay(module, replay_steps(1), gradient_clip_val=0, callbacks=[probe])
    assert module.hparams.max_grad_norm is None and probe.gradient_norms[0] > 1e-2


@pytest.mark.parametrize(
    ("trainer_options", "module_options", "data_options", "message"),
    [
        (
            {"gradient_clip_val": 1.0, "gradient_clip_algorithm": "value"},
            {},
            {},
            "`Trainer(gradient_clip_algorithm='value')` is not supported: GRPOModule clips the gradient norm to its "
            "`GRPOModule(max_grad_norm=1.0)`",
        ),
        (
            {"accumulate_grad_batches": 2},
            {},
            {"gradient_accumulation_steps": 3},
            "`Trainer(accumulate_grad_batches=2)` and `GRPODataModule(gradient_accumulation_steps=3)` disagree",
        ),
        (
            {"gradient_clip_val": 0.5},
            {"max_grad_norm": 2.0},
            {},
            "`Trainer(gradient_clip_val=0.5)` and `GRPOModule(max_grad_norm=2.0)` disagree",
        ),
        (
            {"accumulate_grad_batches": 0},
            {},
            {},
            "`Trainer(accumulate_grad_batches=0)` must be a whole number of at least 1",
        ),
    ],
    ids=["clip_by_value", "accumulation_both_ways", "clip_both_ways", "no_accumulation"],
)
def test_a_flag_we_cannot_map_fails_the_fit_with_one_value_error_naming_our_option(
    trainer_options, module_options, data_options, message, no_leaked_processes
):
    datamodule = tiny_datamodule(4, **data_options)
    module = GRPOModule("tiny-random", **module_options)
    with pytest.raises(ValueError) as error:
        cpu_trainer(**trainer_options).fit(module, datamodule=datamodule)
    assert message in str(error.value) and len(str(error.value).splitlines()) == 1
    assert module.policy is None  # refused before `configure_model`: nothing was loaded or started


def test_accumulate_grad_batches_with_a_data_module_without_the_option_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"GRPODataModule\(gradient_accumulation_steps=...\)`, which ReplaySource"):
        fit_replay(GRPOModule("tiny-random"), replay_steps(1), accumulate_grad_batches=2)


def test_mapping_gives_our_options_the_flags_unless_both_were_given_differently():
    assert mapped() == (1, 1.0)
    assert mapped(accumulate_grad_batches=4, gradient_clip_val=0.25) == (4, 0.25)
    assert mapped(accumulate_grad_batches=4, gradient_accumulation_steps=4) == (4, 1.0)  # the same value twice
    assert mapped(gradient_clip_val=0.25, max_grad_norm=0.25, gradient_clip_algorithm="norm") == (1, 0.25)
    assert mapped(gradient_clip_val=0, max_grad_norm=None) == (1, None)
    assert mapped(gradient_accumulation_steps=3, max_grad_norm=None) == (3, None)  # no flag: ours stay


def test_mapping_lists_every_problem_in_one_line_named_as_the_command_line_options():
    with pytest.raises(ValueError) as error:
        mapped(
            command_line=True,
            accumulate_grad_batches=2,
            gradient_accumulation_steps=3,
            gradient_clip_val=-1.0,
            gradient_clip_algorithm="value",
        )
    message = str(error.value)
    assert len(message.splitlines()) == 1
    assert "`trainer.accumulate_grad_batches=2` and `data.gradient_accumulation_steps=3` disagree" in message
    assert "`trainer.gradient_clip_algorithm='value'` is not supported" in message
    assert "`trainer.gradient_clip_val=-1.0` must be a non-negative number" in message
    assert "`model.max_grad_norm=1.0`" in message
