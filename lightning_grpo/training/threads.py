"""Sharing the CPU between the trainer and the embedded generator.

On a CPU-only machine the rollout child generates while the trainer trains. With torch's default (one thread per
core) in the trainer plus the generator's threads, the two oversubscribe the cores and both slow down, so
`trainer_threads="auto"` gives the trainer the cores the generator leaves (`benchmarks/async_overlap.py` measures it),
and each side borrows the other's cores while the other is idle (`rollout/core_sharing.py`; the trainer switches at
each decoder layer, forward and backward, through the hooks `borrow_idle_cores` installs).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:
    from ..rollout.core_sharing import CoreSharing

TrainerThreads = int | Literal["auto"] | None


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity, which containers and `taskset` narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def is_trainer_threads(option: object) -> bool:
    """Whether `option` is a valid `trainer_threads`: a positive number of threads, `"auto"` or None."""
    return option is None or option == "auto" or (isinstance(option, int) and option >= 1)


def trainer_threads_for(
    option: TrainerThreads,
    *,
    current: int,
    on_cpu: bool,
    embedded_generator: bool,
    generator_threads: int | None,
    world_size: int,
) -> int | None:
    """The torch threads the trainer should train with, or None to leave torch's setting alone.

    `option` (valid, see `is_trainer_threads`): a number is used as given; None leaves torch alone; `"auto"` applies only where the trainer and the
    embedded generator share one machine's CPU (CPU accelerator, one process, `generator_threads` set) and gives the
    trainer the cores the generator does not use, never more threads than torch has now.
    """
    if option is None or option != "auto":
        return option
    if not (on_cpu and embedded_generator and generator_threads and world_size == 1):
        return None
    threads = max(1, available_cores() - generator_threads)
    return threads if threads < current else None


def borrow_idle_cores(model: torch.nn.Module, sharing: CoreSharing) -> list[Any]:
    """Hooks on `model`'s decoder layers that set the trainer's threads by `sharing.trainer_compute()` before each
    layer's forward and before its backward; returns their handles (`handle.remove()` takes them off).

    Decoder layers are the modules whose class name ends in "DecoderLayer" (every Hugging Face decoder); a model
    without any gets the hooks on itself, switching once per forward and once per backward.
    """
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")] or [model]

    def before_forward(module: torch.nn.Module, args: Any) -> None:
        sharing.trainer_compute()

    def before_backward(grad: torch.Tensor) -> None:
        sharing.trainer_compute()

    def after_forward(module: torch.nn.Module, args: Any, output: Any) -> None:
        hidden = _first_tensor(output)
        if hidden is not None and hidden.requires_grad:
            hidden.register_hook(before_backward)  # runs when this layer's backward is about to start

    handles = []
    for layer in layers:
        handles.append(layer.register_forward_pre_hook(before_forward))
        handles.append(layer.register_forward_hook(after_forward))
    return handles


def _first_tensor(output: Any) -> torch.Tensor | None:
    """A module's main output: the tensor itself, or the first of a tuple or a transformers `ModelOutput`."""
    if hasattr(output, "to_tuple"):  # a ModelOutput (a model without decoder layers hooked on itself)
        output = output.to_tuple()
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None
