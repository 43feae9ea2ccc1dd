"""Lightning's `accumulate_grad_batches` and `gradient_clip_val` for `GRPOModule`, which optimizes manually.

Lightning refuses both flags for a module with manual optimization. `GRPOModule` has its own two knobs with the same
meaning, so the flags are mapped onto them instead:

- `Trainer(accumulate_grad_batches=n)` becomes `GRPODataModule(gradient_accumulation_steps=n)`: each rank runs `n`
  micro-batches (forward and backward) per optimizer step, and one Lightning batch stays one optimizer step.
- `Trainer(gradient_clip_val=v)` becomes `GRPOModule(max_grad_norm=v)` (0 turns clipping off, as in Lightning). Only
  `gradient_clip_algorithm="norm"` (Lightning's default) exists: `"value"` is refused.

An option of ours left at its default counts as not given, so the flag sets it; given both ways with different
values, the mapping refuses, naming both. `GRPOModule.configure_callbacks` applies it (Lightning calls that hook
before its check of the flags) and resets the trainer's flags to their defaults; `lightning-grpo` rewrites its
parsed config the same way before building anything (`lightning_grpo.cli.lightning_flags`).
"""

from __future__ import annotations

import inspect
import math
from typing import Any

from lightning.pytorch.utilities import rank_zero_info

_CLASSES = {"trainer": "Trainer", "data": "GRPODataModule", "model": "GRPOModule"}


def map_lightning_flags(
    *,
    accumulate_grad_batches: Any,
    gradient_clip_val: Any,
    gradient_clip_algorithm: Any,
    gradient_accumulation_steps: int,
    max_grad_norm: float | None,
    gradient_accumulation_steps_default: int = 1,
    max_grad_norm_default: float | None = 1.0,
    command_line: bool = False,
) -> tuple[int, float | None]:
    """The data module's `gradient_accumulation_steps` and the module's `max_grad_norm` once Lightning's flags are
    mapped onto them (see the module's docstring).

    Args:
        accumulate_grad_batches: `Trainer(accumulate_grad_batches=...)`; 1 is Lightning's default (not given).
        gradient_clip_val: `Trainer(gradient_clip_val=...)`; None is Lightning's default (not given).
        gradient_clip_algorithm: `Trainer(gradient_clip_algorithm=...)`: None or `"norm"`.
        gradient_accumulation_steps: the data module's value.
        max_grad_norm: the module's value.
        gradient_accumulation_steps_default: the data module's default (a value equal to it counts as not given).
        max_grad_norm_default: the module's default (likewise).
        command_line: name the options as `lightning-grpo`'s (`trainer.accumulate_grad_batches=2`) instead of as
            the classes' arguments (`Trainer(accumulate_grad_batches=2)`).

    Returns:
        `(gradient_accumulation_steps, max_grad_norm)`.

    Raises:
        ValueError: one message listing every problem: an `accumulate_grad_batches` below 1 or not a whole number,
            a negative `gradient_clip_val`, a `gradient_clip_algorithm` other than `"norm"`, and a flag and our
            option both given with different values.
    """

    def named(option: str, value: Any) -> str:
        section, _, name = option.partition(".")
        return f"`{option}={value!r}`" if command_line else f"`{_CLASSES[section]}({name}={value!r})`"

    problems = []
    steps, norm = gradient_accumulation_steps, max_grad_norm
    if accumulate_grad_batches != 1:
        flag = named("trainer.accumulate_grad_batches", accumulate_grad_batches)
        ours = named("data.gradient_accumulation_steps", gradient_accumulation_steps)
        if not _is_count(accumulate_grad_batches):
            problems.append(f"{flag} must be a whole number of at least 1 (micro-batches per optimizer step)")
        elif gradient_accumulation_steps not in (gradient_accumulation_steps_default, accumulate_grad_batches):
            problems.append(f"{flag} and {ours} disagree: both set the micro-batches per optimizer step; set one")
        else:
            steps = accumulate_grad_batches
    algorithm = _algorithm_name(gradient_clip_algorithm)
    if algorithm not in (None, "norm"):
        problems.append(
            f"{named('trainer.gradient_clip_algorithm', algorithm)} is not supported: GRPOModule clips the gradient "
            f"norm to its {named('model.max_grad_norm', max_grad_norm)}; use gradient_clip_algorithm='norm' "
            "or leave it unset"
        )
    if gradient_clip_val is not None:
        flag = named("trainer.gradient_clip_val", gradient_clip_val)
        ours = named("model.max_grad_norm", max_grad_norm)
        if not _is_clip_value(gradient_clip_val):
            problems.append(f"{flag} must be a non-negative number (0 or None: no clipping); it sets {ours}")
        elif max_grad_norm not in (max_grad_norm_default, float(gradient_clip_val) or None):
            problems.append(f"{flag} and {ours} disagree: both set the gradient norm clipping; set one")
        else:
            norm = float(gradient_clip_val) or None  # 0 turns clipping off, as in Lightning
    if problems:
        raise ValueError("; ".join(problems) + ".")
    return steps, norm


def apply_lightning_flags(trainer: Any, module: Any, datamodule: Any) -> None:
    """Map the trainer's `accumulate_grad_batches` and `gradient_clip_val` onto `datamodule` and `module`, and reset
    the trainer's flags, so Lightning's check for manual optimization passes. Every rank; a no-op without them.

    Called by `GRPOModule.configure_callbacks`, which Lightning calls in `Trainer.fit` before it checks the flags and
    before `setup`, so the data module plans its steps with the mapped value.

    Raises:
        ValueError: see `map_lightning_flags`; also `accumulate_grad_batches` with a data module that has no
            `gradient_accumulation_steps` (such as a `StepReplay`, whose steps are already planned).
    """
    accumulate, clip, algorithm = (
        trainer.accumulate_grad_batches,
        trainer.gradient_clip_val,
        trainer.gradient_clip_algorithm,
    )
    if accumulate == 1 and clip is None and algorithm is None:
        return
    data_options = getattr(datamodule, "hparams", {})
    if accumulate != 1 and "gradient_accumulation_steps" not in data_options:
        raise ValueError(
            f"`Trainer(accumulate_grad_batches={accumulate!r})` sets the micro-batches per optimizer step of "
            f"`GRPODataModule(gradient_accumulation_steps=...)`, which {type(datamodule).__name__} does not have: "
            "remove it, and plan the steps with as many micro-batches instead."
        )
    steps, norm = map_lightning_flags(
        accumulate_grad_batches=accumulate,
        gradient_clip_val=clip,
        gradient_clip_algorithm=algorithm,
        gradient_accumulation_steps=data_options.get("gradient_accumulation_steps", 1),
        max_grad_norm=module.hparams.max_grad_norm,
        gradient_accumulation_steps_default=_default(datamodule, "gradient_accumulation_steps", 1),
        max_grad_norm_default=_default(module, "max_grad_norm", 1.0),
    )
    if accumulate != 1:
        data_options["gradient_accumulation_steps"] = steps  # what a checkpoint records
        if hasattr(datamodule, "options"):  # what the data module reads (`lightning_grpo.options`)
            datamodule.options = datamodule.options.replace(gradient_accumulation_steps=steps)
        rank_zero_info(
            f"`Trainer(accumulate_grad_batches={accumulate})`: GRPODataModule(gradient_accumulation_steps={steps})"
        )
    if clip is not None:
        module.hparams.max_grad_norm = norm
        rank_zero_info(f"`Trainer(gradient_clip_val={clip})`: GRPOModule(max_grad_norm={norm})")
    trainer.accumulate_grad_batches, trainer.gradient_clip_val, trainer.gradient_clip_algorithm = 1, None, None


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _is_clip_value(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _algorithm_name(algorithm: Any) -> str | None:
    """`"norm"`, `"value"`, ... of a `GradClipAlgorithmType` (the trainer's) or a string (a config's)."""
    if algorithm is None:
        return None
    return str(getattr(algorithm, "value", algorithm)).lower()


def _default(owner: Any, name: str, fallback: Any) -> Any:
    """The default of `name` in the first `__init__` of `owner`'s class hierarchy that takes it."""
    for cls in type(owner).__mro__:
        init = vars(cls).get("__init__")
        parameter = inspect.signature(init).parameters.get(name) if init is not None else None
        if parameter is not None and parameter.default is not inspect.Parameter.empty:
            return parameter.default
    return fallback
