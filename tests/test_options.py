"""The data module's typed option records: every plain argument in exactly one record, with the signature's type and
no default of its own; the loop arguments the session sets are what the loop takes."""

from __future__ import annotations

import dataclasses
import inspect
import pickle
import typing

import pytest

from lightning_grpo import GRPODataModule
from lightning_grpo import datamodule as datamodule_module
from lightning_grpo.options import LOOP_OPTION_NAMES, DataModuleOptions, LoopOptions, is_trainer_threads
from lightning_grpo.rollout.loop import GRPORolloutLoop


def init_arguments(cls: type) -> dict[str, inspect.Parameter]:
    return {name: p for name, p in inspect.signature(cls.__init__).parameters.items() if name != "self"}


def record_fields() -> dict[str, list[str]]:
    """Each option name -> the records that hold it."""
    holders: dict[str, list[str]] = {}
    for record in DataModuleOptions.records().values():
        for field in dataclasses.fields(record):
            holders.setdefault(field.name, []).append(record.__name__)
    return holders


def test_every_data_module_argument_is_in_exactly_one_record_or_is_an_object_argument():
    holders = record_fields()
    objects = set(datamodule_module._OBJECT_ARGUMENTS)
    arguments = init_arguments(GRPODataModule)
    misplaced = {
        name: holders.get(name, []) + (["_OBJECT_ARGUMENTS"] if name in objects else [])
        for name in arguments
        if len(holders.get(name, [])) + (name in objects) != 1
    }
    assert not misplaced, f"each argument must be in exactly one record or in _OBJECT_ARGUMENTS: {misplaced}"
    assert set(holders) | objects == set(arguments), "a record field or object argument that is no argument"


def test_each_record_field_has_the_signature_type_and_no_default_of_its_own():
    signature_types = typing.get_type_hints(GRPODataModule.__init__)
    for record in DataModuleOptions.records().values():
        field_types = typing.get_type_hints(record)
        for field in dataclasses.fields(record):
            assert field_types[field.name] == signature_types[field.name], (record.__name__, field.name)
            assert field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING


def test_the_records_hold_the_arguments_given_and_the_signature_defaults():
    options = GRPODataModule(model="tiny-random", temperature=0.7, stop=["\n\n"], vllm_failover=True).options
    assert options.sampling.temperature == 0.7 and options.sampling.stop == ["\n\n"]
    assert options.vllm.vllm_failover is True
    assert options.vllm.vllm_server_timeout == init_arguments(GRPODataModule)["vllm_server_timeout"].default
    assert options.data.model == "tiny-random" and options.generation.generator == "embedded"


def test_records_are_frozen_slotted_and_survive_pickling():
    options = GRPODataModule(model="tiny-random").options
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.sampling.temperature = 2.0  # type: ignore[misc]
    with pytest.raises(AttributeError):
        options.sampling.temperatrue  # type: ignore[attr-defined]  # noqa: B018
    assert pickle.loads(pickle.dumps(options)) == options


def test_replace_changes_an_option_in_its_record_and_refuses_an_unknown_name():
    options = GRPODataModule(model="tiny-random").options
    changed = options.replace(gradient_accumulation_steps=3, temperature=0.5)
    assert changed.steps.gradient_accumulation_steps == 3 and changed.sampling.temperature == 0.5
    assert changed.rewards == options.rewards and options.steps.gradient_accumulation_steps == 1
    with pytest.raises(TypeError, match="gradient_acumulation_steps"):
        options.replace(gradient_acumulation_steps=3)


def test_from_hparams_names_a_missing_option():
    hparams = dict(GRPODataModule(model="tiny-random").hparams)
    del hparams["top_k"]
    with pytest.raises(KeyError, match="top_k"):
        DataModuleOptions.from_hparams(hparams)


def test_the_loop_options_are_the_loops_arguments_and_loop_kwargs_may_not_set_them():
    taken = set()
    for cls in GRPORolloutLoop.__mro__:
        if "__init__" in vars(cls) and cls is not object:
            taken |= set(inspect.signature(cls.__init__).parameters)
    assert {field.name for field in dataclasses.fields(LoopOptions)} == LOOP_OPTION_NAMES
    assert taken >= LOOP_OPTION_NAMES, sorted(LOOP_OPTION_NAMES - taken)
    with pytest.raises(ValueError, match="temperature"):
        GRPODataModule(model="tiny-random", loop_kwargs={"temperature": 0.5})


@pytest.mark.parametrize(("value", "valid"), [(None, True), ("auto", True), (2, True), (0, False), ("all", False)])
def test_is_trainer_threads(value, valid):
    assert is_trainer_threads(value) is valid
