"""`lightning-grpo`'s `--trainer.accumulate_grad_batches` and `--trainer.gradient_clip_val`, moved onto
`--data.gradient_accumulation_steps` and `--model.max_grad_norm` before the classes are built.

The mapping is `lightning_grpo.training.lightning_flags`'s (the one `Trainer.fit` applies from Python); doing it on
the parsed config lets `GRPODataModule.check_data` check the step size the run will have, and the saved
`config.yaml` holds the values the run used.
"""

from __future__ import annotations

import inspect
from typing import Any

from jsonargparse import ArgumentParser, Namespace

from ..datamodule import GRPODataModule
from ..module import GRPOModule
from ..training.lightning_flags import map_lightning_flags

_TRAINER_DEFAULTS = {
    "trainer.accumulate_grad_batches": 1,
    "trainer.gradient_clip_val": None,
    "trainer.gradient_clip_algorithm": None,
}


def move_lightning_flags(config: Namespace, parser: ArgumentParser) -> None:
    """Move the trainer's `accumulate_grad_batches` and `gradient_clip_val` in `config` (one subcommand's) onto the
    data module's and the module's options, and reset them; a value we refuse ends the command through
    `parser.error` (exit code 2, one line naming the options)."""
    given = {key: config.get(key, default) for key, default in _TRAINER_DEFAULTS.items()}
    if given == _TRAINER_DEFAULTS:
        return
    try:
        steps, norm = map_lightning_flags(
            accumulate_grad_batches=given["trainer.accumulate_grad_batches"],
            gradient_clip_val=given["trainer.gradient_clip_val"],
            gradient_clip_algorithm=given["trainer.gradient_clip_algorithm"],
            gradient_accumulation_steps=config.get("data.gradient_accumulation_steps", 1),
            max_grad_norm=config.get("model.max_grad_norm"),
            gradient_accumulation_steps_default=_default(GRPODataModule, "gradient_accumulation_steps"),
            max_grad_norm_default=_default(GRPOModule, "max_grad_norm"),
            command_line=True,
        )
    except ValueError as error:
        parser.error(f"ValueError: {error}")
    config["data.gradient_accumulation_steps"] = steps
    config["model.max_grad_norm"] = norm
    for key, default in _TRAINER_DEFAULTS.items():
        config[key] = default


def _default(cls: type, name: str) -> Any:
    return inspect.signature(cls).parameters[name].default
