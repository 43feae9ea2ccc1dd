"""Sharing the CPU between the trainer and the embedded generator.

On a CPU-only machine the rollout child generates while the trainer trains. With torch's default (one thread per
core) in the trainer plus the generator's threads, the two oversubscribe the cores and both slow down, so
`trainer_threads="auto"` gives the trainer the cores the generator leaves (`benchmarks/async_overlap.py` measures it),
and each side borrows the other's cores while the other is idle (`rollout/core_sharing.py`; the trainer switches at
each decoder layer, forward and backward, through the hooks `borrow_idle_cores` installs).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch

from ..options import GeneratorOptions, TrainerThreads
from .heap import FitHeap

if TYPE_CHECKING:
    from ..rollout.core_sharing import CoreSharing

log = logging.getLogger(__name__)


def runs_on_cpu(trainer: Any) -> bool:
    """Whether `trainer` (a Lightning `Trainer`) trains on the CPU accelerator."""
    from lightning.pytorch.accelerators import CPUAccelerator

    return isinstance(trainer.accelerator, CPUAccelerator)


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity, which containers and `taskset` narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


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

    `option` (valid, see `lightning_grpo.options.is_trainer_threads`): a number is used as given; None leaves torch
    alone; `"auto"` applies only where the trainer and the embedded generator share one machine's CPU (CPU
    accelerator, one process, `generator_threads` set) and gives the trainer the cores the generator does not use,
    never more threads than torch has now.
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


class FitThreads:
    """The trainer's torch threads during one fit, the core sharing with the embedded generator, and on a CPU its
    heap (`heap.FitHeap`: the memory each step frees kept for the next).

    `apply` sets the threads `trainer_threads_for` chooses (once per fit; a later `setup` keeps them) and keeps freed
    memory on a CPU, `borrow_generator_cores` hooks the policy so that it borrows the generator's idle cores, and
    `restore` puts the thread count and malloc back and removes the hooks.
    """

    def __init__(self) -> None:
        self.core_sharing: CoreSharing | None = None
        self.heap = FitHeap()
        self._before: int | None = None
        self._hooks: list[Any] = []

    def apply(self, generation: GeneratorOptions, *, on_cpu: bool, world_size: int) -> None:
        """Set the trainer's threads from the data module's `trainer_threads`, `generator`, `generator_threads` and
        `generator_replicas` (the cores every replica takes)."""
        from ..rollout.core_sharing import CoreSharing

        self.heap.apply(on_cpu=on_cpu)
        if self._before is not None:  # already set by an earlier `fit` setup
            return
        current = torch.get_num_threads()
        replicas = generation.generator_replicas
        generator_threads = generation.generator_threads
        threads = trainer_threads_for(
            generation.trainer_threads,
            current=current,
            on_cpu=on_cpu,
            embedded_generator=generation.generator == "embedded",
            generator_threads=generator_threads and generator_threads * replicas,
            world_size=world_size,
        )
        if threads is None:
            return
        self._before = current
        torch.set_num_threads(threads)
        # A number asked for is used as given, never lent or borrowed; replicas keep their own cores.
        if generation.trainer_threads == "auto" and replicas == 1 and generator_threads:
            self.core_sharing = CoreSharing(trainer_threads=threads, generator_threads=generator_threads)
        log.info(
            "Training with %d torch threads (was %d) beside the generator's %s%s.",
            threads,
            current,
            generator_threads,
            ", each side borrowing the other's while it is idle" if self.core_sharing else "",
        )

    def borrow_generator_cores(self, policy: torch.nn.Module) -> None:
        """With core sharing, hook `policy` to borrow the generator's idle cores (once)."""
        if self.core_sharing is not None and not self._hooks:
            self._hooks = borrow_idle_cores(policy, self.core_sharing)

    def restore(self) -> None:
        """Remove the hooks and put the thread count and malloc back as they were before `apply`."""
        self.heap.restore()
        for handle in self._hooks:
            handle.remove()
        self._hooks, self.core_sharing = [], None
        before, self._before = self._before, None
        if before is not None:
            torch.set_num_threads(before)
