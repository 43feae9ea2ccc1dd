"""GRPOModule's typed options: each record field is a module argument of the same type, read once from its
hyper-parameters; the helpers read the records."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from lightning_grpo import GRPOModule
from lightning_grpo.training.loss_options import LossOptions, ReferenceSync
from lightning_grpo.training.module_options import ModuleOptions, ValidationOptions


@pytest.mark.parametrize("record", [LossOptions, ReferenceSync, ValidationOptions, ModuleOptions])
def test_each_field_is_a_module_argument_of_the_same_type(record):
    signature = typing.get_type_hints(GRPOModule.__init__)
    hints = typing.get_type_hints(record)
    nested = {field.name for field in dataclasses.fields(record) if dataclasses.is_dataclass(hints[field.name])}
    for field in dataclasses.fields(record):
        if field.name not in nested:
            assert hints[field.name] == signature[field.name], (record.__name__, field.name)


def test_the_records_hold_the_arguments_given():
    module = GRPOModule(
        "tiny-random", num_generations_eval=4, val_temperature=0.7, beta=0.1, sync_ref_model=True, num_iterations=2
    )
    options = module.options
    assert options.validation == ValidationOptions(None, 4, 0.7, 1.0)
    assert options.reference == ReferenceSync(True, 0.6, 512) and options.num_iterations == 2
    assert options.loss.beta == 0.1 and module.loss_options is options.loss


def test_from_hparams_checks_the_loss_options_and_refuses_tr_dpo_with_lora():
    hparams = dict(GRPOModule("tiny-random", beta=0.1, sync_ref_model=True).hparams)
    with pytest.raises(ValueError, match="sync_ref_model=True"):
        ModuleOptions.from_hparams(hparams, lora=True)
    with pytest.raises(ValueError, match="epsilon=-1"):
        ModuleOptions.from_hparams(hparams | {"epsilon": -1}, lora=False)
