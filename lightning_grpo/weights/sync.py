"""WeightSync: the one owner of pushing the trainer's weights to the generator, and of the policy version."""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol, runtime_checkable

import torch

from .parameters import ChangedScope, changed_names, full_parameters, generator_parameters

log = logging.getLogger(__name__)


@runtime_checkable
class WeightTransfer(Protocol):
    """TRL's `WeightTransferProtocol`: a backend that moves weights into a generator (called on rank 0 only)."""

    def init_weight_transfer(self) -> None:
        """Set up the transfer (an NCCL group, a shared block); called once, before the first send."""

    def pause(self) -> None:
        """Hold the generator before weights are swapped in."""

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Stream `(name, tensor)` pairs into the generator."""

    def resume(self) -> None:
        """Let the generator go on with the new weights."""

    def destroy(self) -> None:
        """Release the transfer's resources."""


class WeightSync:
    """Pushes the policy's full weights to the generator, and keeps the version they carry.

    Every rank holds one and calls `push` at the same points, because gathering a sharded parameter is a collective;
    only the rank holding the `transfer` (rank 0) sends. Before its first send the transfer is initialised, once,
    whatever the backend (TRL's NCCL client silently sends nothing before that). Each push streams
    `generator_parameters(policy)`: full tensors under the policy's checkpoint names, TRL's vLLM manifest when
    `trainable_only`; a LoRA policy's adapted layers merged with their adapters, under the base model's names (the
    trained copy is not merged). With `changed_only`, every push after a run's first one streams only the tensors
    training can change (`changed_names`: a LoRA policy's adapted layers, trainable parameters), and the transfer
    (`send_weights(..., partial=True)`) keeps the rest. With `adapter_only`, each push streams the LoRA adapter
    itself (`adapters.adapter_tensors`), for a generator that applies it (`VLLMLoRAWeightTransfer`).

    `version` is the run's one policy version. The first push of a run (or of a resumed run) publishes the current
    version; each later push publishes the next one. A backend whose `send_weights` takes `version` (the shared-memory
    and vLLM HTTP transfers) gets it with the weights, so the embedded generator tags its samples with the version of
    the weights it actually applied; `on_version` listeners (the rollout worker's `update_model_version`, read by the
    vLLM path) hear of it once it is published. The staleness filter, the metrics and the checkpoint
    (`state_dict`) read the same number.

    Args:
        transfer: on the sending rank, the backend (a `SharedMemoryWeightTransfer`, a `VLLMHTTPWeightTransfer`, TRL's
            `WeightTransferClient`, any TRL `WeightTransferProtocol`) or a factory called with the policy at the first
            push (`SharedMemoryWeightTransfer` itself is one); None on the other ranks.
        trainable_only: stream TRL's vLLM manifest (trainable parameters only) instead of every parameter. The same
            on every rank.
        changed_only: after the first push, stream only the tensors that can change: `"tensors"` exactly those,
            `"modules"` those and every tensor of the same parent module (for a vLLM server, which reloads fused
            q/k/v and gate/up layers whole); None streams everything every time. The same on every rank.
        adapter_only: stream the LoRA adapter instead of the merged weights. The same on every rank.

    Raises:
        TypeError: `transfer` is neither a `WeightTransferProtocol` nor a callable (the message names what it lacks).
        ValueError: both `changed_only` and `adapter_only`.

    Example::

        sync = WeightSync(SharedMemoryWeightTransfer if rank == 0 else None)
        sync.push(policy)  # every rank; version 0 reaches the generator
        ...                # an optimizer step
        sync.push(policy)  # version 1
    """

    def __init__(
        self,
        transfer: WeightTransfer | Callable[[torch.nn.Module], WeightTransfer] | None = None,
        *,
        trainable_only: bool = False,
        changed_only: ChangedScope | None = None,
        adapter_only: bool = False,
    ) -> None:
        if changed_only is not None and adapter_only:
            raise ValueError(
                f"`WeightSync(changed_only={changed_only!r}, adapter_only=True)`: an adapter push has no merged "
                "layers to leave out. Pass one of them."
            )
        self.transfer: WeightTransfer | None = None
        self._make_transfer: Callable[[torch.nn.Module], WeightTransfer] | None = None
        if isinstance(transfer, type) or (callable(transfer) and not isinstance(transfer, WeightTransfer)):
            self._make_transfer = transfer  # a class (or function) that builds the transfer from the policy
        elif isinstance(transfer, WeightTransfer):
            self.transfer = transfer
        elif transfer is not None:
            missing = [name for name in _PROTOCOL_METHODS if not callable(getattr(transfer, name, None))]
            raise TypeError(
                f"`WeightSync(transfer={type(transfer).__name__})` is not a weight transfer: it lacks {missing} of "
                f"TRL's WeightTransferProtocol ({', '.join(_PROTOCOL_METHODS)}), and is not a factory of one."
            )
        self.trainable_only = trainable_only
        self.changed_only = changed_only
        self.adapter_only = adapter_only
        self.version = 0
        self.last_push_s: float | None = None
        self.last_push_bytes = 0  # bytes of the tensors the last push streamed to the transfer (the sending rank)
        self._published = False
        self._initialised = False
        self._listeners: list[Callable[[int], None]] = []
        self._closed = False

    @property
    def sends(self) -> bool:
        """Whether this rank sends (holds a transfer or its factory)."""
        return self.transfer is not None or self._make_transfer is not None

    def on_version(self, listener: Callable[[int], None]) -> None:
        """Call `listener(version)` on the sending rank after each published push (and now, with the current one)."""
        self._listeners.append(listener)
        if self._published:
            listener(self.version)

    def push(self, policy: torch.nn.Module, *, wrapped: torch.nn.Module | None = None) -> int:
        """Every rank: stream `policy`'s full parameters; the sending rank publishes them. Returns the version.

        Args:
            policy: the unwrapped policy (its checkpoint names are the generator's).
            wrapped: the strategy's wrapper around the LightningModule (`trainer.model`), for FSDP1's gather.

        Raises:
            RuntimeError: after `close()`.
            Exception: whatever the transfer raises; the other ranks' gathers still complete, so no rank is left in a
                collective.
        """
        if self._closed:
            raise RuntimeError("`WeightSync.push()` called after `close()`; a new run needs a new WeightSync.")
        if self.transfer is None and self._make_transfer is not None:
            self.transfer = self._make_transfer(policy)
        version = self.version + 1 if self._published else self.version
        partial = self.changed_only is not None and self._published  # a run's first push is always whole
        started = time.monotonic()
        with full_parameters(wrapped if wrapped is not None else policy):
            stream = self._stream(policy, partial)
            try:
                if self.transfer is not None:
                    self._send(self.transfer, self._counted(stream), version, partial)
            finally:
                for _ in stream:  # gathers the sender did not reach (other ranks, or a failed send) still happen
                    pass
        self.version = version
        self._published = True
        self.last_push_s = time.monotonic() - started
        for listener in self._listeners if self.transfer is not None else ():
            listener(version)
        return version

    def _stream(self, policy: torch.nn.Module, partial: bool) -> Iterator[tuple[str, torch.Tensor]]:
        if self.adapter_only:
            from .adapters import adapter_tensors

            return adapter_tensors(policy)
        names = None
        if partial and self.changed_only is not None:
            names = changed_names(policy, trainable_only=self.trainable_only, scope=self.changed_only)
        return generator_parameters(policy, trainable_only=self.trainable_only, names=names)

    def _counted(self, stream: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        self.last_push_bytes = 0
        for name, tensor in stream:
            self.last_push_bytes += tensor.numel() * tensor.element_size()
            yield name, tensor

    def _send(
        self, transfer: WeightTransfer, stream: Iterator[tuple[str, torch.Tensor]], version: int, partial: bool
    ) -> None:
        if not self._initialised:
            transfer.init_weight_transfer()
            self._initialised = True
        kwargs: dict[str, Any] = {"version": version} if _takes(transfer, "version") else {}
        if partial:
            if not _takes(transfer, "partial"):
                raise TypeError(
                    f"`WeightSync(changed_only={self.changed_only!r})` sends partial pushes, but "
                    f"{type(transfer).__name__}.send_weights takes no `partial`. Leave `changed_only` unset for it."
                )
            kwargs["partial"] = True
        transfer.pause()
        try:
            transfer.send_weights(stream, **kwargs)
        finally:
            transfer.resume()
        log.debug("Pushed the policy's weights as version %d%s.", version, " (changed tensors)" if partial else "")

    def receiver(self) -> Any:
        """The generator's side of the transfer (`SharedMemoryWeightTransfer.receiver()`), for the embedded generator.

        Raises:
            TypeError: the transfer has no receiver (a vLLM server receives by itself).
        """
        get = getattr(self.transfer, "receiver", None)
        if get is None:
            raise TypeError(
                f"The weight transfer {type(self.transfer).__name__} has no receiver for a generator (push once "
                "first; a vLLM server receives by itself)."
            )
        return get()

    def state_dict(self) -> dict[str, Any]:
        """`{"version": ...}`: saved in checkpoints, so a resumed run never reuses a version number."""
        return {"version": self.version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the version; the next push republishes it (the restored weights are that version)."""
        self.version = int(state.get("version", 0))
        self._published = False

    def close(self) -> None:
        """Destroy the transfer (idempotent); a later push needs a new `WeightSync`."""
        self._closed = True
        self._make_transfer = None
        transfer, self.transfer = self.transfer, None
        if transfer is not None:
            transfer.destroy()


_PROTOCOL_METHODS = ("init_weight_transfer", "pause", "send_weights", "resume", "destroy")


def _takes(transfer: Any, argument: str) -> bool:
    """Whether `transfer.send_weights` takes `argument` (ours take `version` and `partial`; TRL's protocol neither)."""
    try:
        return argument in inspect.signature(transfer.send_weights).parameters
    except (TypeError, ValueError):
        return False
