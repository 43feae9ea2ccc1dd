"""Weight sync to the embedded generator through shared memory: the trainer's side.

`SharedMemoryWeightTransfer` implements TRL's `WeightTransferProtocol` (`init_weight_transfer`, `pause`,
`send_weights`, `resume`, `destroy`). It allocates one shared-memory block once, sized from the model's parameters: a
64-byte header (sequence number, version, a valid flag), a table of the sequence number each tensor was last written
under, then every tensor at a 64-byte aligned offset (the format of `lightning_grpo.rollout.weight_receiver`). A
partial send (after a full one) writes only the tensors that changed, and the generator copies only the tensors
written since its last copy. The generator's side, `SharedMemoryWeightReceiver` (`transfer.receiver()`), lives in
`rollout/`, since the rollout child imports it: a small picklable object (the block's name, the lock file's path and
the manifest) that the embedded generator polls between decode steps.

A sync is `pause()` (take the lock, waiting for a copy in progress to finish), `send_weights(named_tensors,
version)` (memcpy into the block), `resume()` (publish: bump the sequence number, set the version, release the
lock). Before its next decode step the generator sees the new sequence number, copies the block into its model under
the lock and samples every next token with it; each completion is tagged with the oldest version that sampled any of
its tokens. Both copies are one-thread memcpys, or casting copies where dtypes differ.

The lock is an `flock` on the block's file (`/dev/shm/<name>` on Linux; elsewhere a small file in the temp folder),
not a multiprocessing lock, for two reasons: the receiver then pickles anywhere (cloudpickle, `pickle.dumps`
checks, loop keyword arguments), not only as a process argument; and the kernel releases it when its holder dies, so
a rollout child killed mid-copy never hangs the trainer's next `pause()`. This makes the transfer POSIX-only.

Cleanup: `destroy()`, garbage collection and interpreter exit unlink the block. After a SIGKILL of the trainer (or
an `os._exit`), Python's resource tracker unlinks it once every process that shares the tracker (the trainer and the
rollout child it spawned) has exited; on Linux nothing is left, elsewhere an empty `<tmp>/lgrpo_*.lock` file.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import tempfile
import weakref
from collections.abc import Iterable
from multiprocessing import shared_memory

import torch

from ..models.lora import is_peft_model
from ..rollout.weight_receiver import (
    H_MAGIC,
    H_SEQ,
    H_VALID,
    H_VERSION,
    MAGIC,
    Block,
    SharedMemoryWeightReceiver,
    build_manifest,
    copy_into,
    try_flock,
)

log = logging.getLogger(__name__)

_SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared memory


def _lock_file(block_name: str) -> str:
    """The file whose flock guards the block: on Linux the block's own file, so that nothing else is left behind."""
    block_file = os.path.join(_SHM_DIR, block_name)
    if os.path.exists(block_file):
        return block_file
    return os.path.join(tempfile.gettempdir(), f"{block_name}.lock")


def _release(block: Block, lock_fd: int, lock_path: str) -> None:
    """Unmap and unlink the block and the lock file; safe to call twice (it is also the finalizer)."""
    block.close()
    with contextlib.suppress(FileNotFoundError):
        block.shm.unlink()
    with contextlib.suppress(OSError):
        os.close(lock_fd)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(lock_path)  # a separate lock file (no /dev/shm); on Linux it was the block, already gone


def _module_manifest(model: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """A model's tensors as the generator holds them: a LoRA (PEFT) policy's base parameters under their base names
    (it receives merged weights), any other model's parameters with tied names kept as aliases."""
    if is_peft_model(model):
        from .parameters import generator_manifest

        return generator_manifest(model)
    return model.named_parameters(remove_duplicate=False)


class SharedMemoryWeightTransfer:
    """Trainer side of the shared-memory weight sync to the embedded generator; TRL's `WeightTransferProtocol`.

    The block is allocated once, here, from the tensors' names, shapes and dtypes (only metadata is read: meta
    tensors and DTensors work; a LoRA policy's manifest is its base model's, which receives merged weights). A
    `send_weights` covers every tensor of this manifest, or, with `partial=True` once a full send was published, the
    tensors that changed (`WeightSync` sends a LoRA policy's adapted layers only); tensors that share storage (an
    `lm_head` tied to the embeddings) are sent once, under the first name, and a tied name in a send is skipped. A
    tensor is cast to the manifest's dtype on the copy.

    Hand the generator its side with `receiver()` before the rollout child is spawned; it pickles in microseconds.
    The generator applies a sync between two decode steps, so a completion carries the new version only when all of
    its tokens were sampled with the new weights (one that was running carries the older version). `pause()` does not stop generation (unlike vLLM's pause): it only keeps
    the generator from copying while the buffers are written.

    Args:
        model_or_named_tensors: the policy (its `named_parameters()` are the manifest) or `(name, tensor)` pairs.
        lock_timeout_s: how long `pause()` waits for a generator that is copying the previous sync.

    Raises:
        ValueError: no tensors, or a name twice.

    Example::

        transfer = SharedMemoryWeightTransfer(policy)
        generator = EmbeddedGenerator(
            PolicySpec.from_model(policy), weight_receiver=transfer.receiver()
        )
        transfer.pause()
        transfer.send_weights(policy.named_parameters(), version=1)
        transfer.resume()  # the generator's next batch samples with them, as version 1
        transfer.destroy()
    """

    def __init__(
        self,
        model_or_named_tensors: torch.nn.Module | Iterable[tuple[str, torch.Tensor]],
        *,
        lock_timeout_s: float = 60.0,
    ) -> None:
        named = model_or_named_tensors
        if isinstance(named, torch.nn.Module):
            named = _module_manifest(named)
        self._manifest = build_manifest(named)
        self._lock_timeout_s = lock_timeout_s
        block_name = f"lgrpo_{os.getpid()}_{secrets.token_hex(4)}"  # macOS caps shm names at 31 characters
        shm = shared_memory.SharedMemory(name=block_name, create=True, size=self._manifest.size)
        self._lock_path = _lock_file(block_name)
        self._lock_fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        self._block = Block(shm, self._manifest)
        self._block.header[H_MAGIC] = MAGIC
        self._finalizer = weakref.finalize(self, _release, self._block, self._lock_fd, self._lock_path)
        self._paused = False
        self._pending_version: int | None = None
        self._send_failed = False
        self._version = 0
        self._complete = False  # a full send was published: partial sends may follow

    @property
    def block_name(self) -> str:
        """Name of the shared-memory block (under `/dev/shm` on Linux)."""
        return self._block.shm.name

    @property
    def lock_path(self) -> str:
        return self._lock_path

    @property
    def version(self) -> int:
        """Version of the last published weights; 0 before the first `resume()` that published a send."""
        return self._version

    @property
    def nbytes(self) -> int:
        """Size of the shared block in bytes."""
        return self._manifest.size

    def receiver(self) -> SharedMemoryWeightReceiver:
        """The generator's side; pass it to `EmbeddedGenerator(weight_receiver=...)` (it may cross processes)."""
        self._check_open("receiver")
        return SharedMemoryWeightReceiver(self.block_name, self._lock_path, self._manifest)

    def init_weight_transfer(self) -> None:
        """Nothing to set up: the block exists from `__init__` on. Raises if the transfer was destroyed."""
        self._check_open("init_weight_transfer")

    def pause(self) -> None:
        """Take the lock, so the generator cannot copy while `send_weights` writes. Called before `send_weights`.

        Raises:
            TimeoutError: a generator held the lock for `lock_timeout_s` (it is stuck inside a copy).
        """
        self._check_open("pause")
        if self._paused:
            return
        if not try_flock(self._lock_fd, fcntl.LOCK_EX, self._lock_timeout_s):
            raise TimeoutError(
                f"`SharedMemoryWeightTransfer.pause()` waited {self._lock_timeout_s} s for the generator to finish "
                f"copying weights (lock file {self._lock_path}). Check that the rollout child is not stopped, or "
                "raise `lock_timeout_s`."
            )
        self._paused = True

    def send_weights(
        self, iterator: Iterable[tuple[str, torch.Tensor]], version: int | None = None, *, partial: bool = False
    ) -> None:
        """Write `(name, tensor)` pairs into the shared block; they reach the generator at the next `resume()`.

        Takes the lock first if `pause()` was not called. A failed send is never published.

        Args:
            iterator: every tensor of the manifest once (tied names may be included; they are skipped); with
                `partial`, only the tensors that changed since the last send.
            version: the model version of these weights, which the generator's samples will carry; defaults to the
                last published version + 1. It may not go down.
            partial: the tensors left out keep the values of earlier sends, and the generator copies only the
                tensors sent. Allowed once a full send was published.

        Raises:
            ValueError: a decreasing version, a name not in the manifest, a shape that differs from the manifest,
                tensors missing from a full send, or a partial send before any full one. Each message names the
                tensor.
        """
        self._check_open("send_weights")
        version = self._version + 1 if version is None else int(version)
        if version < self._version:
            raise ValueError(
                f"`SharedMemoryWeightTransfer.send_weights(version={version})`: version {self._version} is already "
                "published and versions may not go down. Pass the trainer's model version."
            )
        if partial and not self._complete:
            raise ValueError(
                "`SharedMemoryWeightTransfer.send_weights(partial=True)` before a full send was published: the "
                "generator may have no other copy of the tensors left out. Send every tensor first."
            )
        self.pause()
        self._pending_version = None
        self._send_failed = True  # until every tensor is written
        self._block.header[H_VALID] = 0
        written = self._write(iterator)
        missing = [spec.name for spec in self._manifest.specs if spec.name not in written]
        if missing and not partial:
            raise ValueError(
                f"`SharedMemoryWeightTransfer.send_weights` got no tensor for {missing[:4]} ({len(missing)} of "
                f"{len(self._manifest.specs)} missing). Send every tensor of the model the transfer was built from "
                "(frozen ones too): the generator may have no other copy of them."
            )
        self._block.header[H_VALID] = 1
        self._pending_version = version
        self._send_failed = False

    def _write(self, iterator: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        written = set()
        block, aliases = self._block, self._manifest.aliases
        views, sequence = block.views, int(block.header[H_SEQ]) + 1  # the number the next publish takes
        for name, tensor in iterator:
            if name in aliases:
                continue  # shares storage with aliases[name], which the send carries
            view = views.get(name)
            if view is None:
                raise ValueError(
                    f"`SharedMemoryWeightTransfer.send_weights` got tensor {name!r}, which is not in its manifest "
                    f"(first names: {list(views)[:3]}). Build the transfer from the model whose parameters you send, "
                    "with the same names (unwrap DDP/FSDP/Lightning prefixes)."
                )
            if tuple(tensor.shape) != tuple(view.shape):
                raise ValueError(
                    f"`SharedMemoryWeightTransfer.send_weights` got tensor {name!r} with shape {tuple(tensor.shape)}, "
                    f"but the manifest says {tuple(view.shape)}. Send full (unsharded) tensors of the same model."
                )
            copy_into(view, tensor.detach())
            block.written_at[block.index[name]] = sequence
            written.add(name)
        return written

    def resume(self) -> None:
        """Publish the last complete send (if any) and release the lock. Called after `send_weights`."""
        self._check_open("resume")
        if not self._paused:
            return
        if self._pending_version is not None:
            header = self._block.header
            header[H_VERSION] = self._pending_version
            header[H_SEQ] += 1
            self._version = self._pending_version
            self._pending_version = None
            self._complete = True
        elif self._send_failed:
            log.warning("SharedMemoryWeightTransfer.resume() after a failed send: nothing was published.")
        self._send_failed = False
        fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        self._paused = False

    def destroy(self) -> None:
        """Unmap and unlink the shared block and the lock file. Idempotent; called on train end."""
        self._paused = False
        self._finalizer()

    def __getstate__(self) -> None:
        raise TypeError(
            "A `SharedMemoryWeightTransfer` owns its shared memory and stays in the trainer process. "
            "Send the generator `transfer.receiver()` instead."
        )

    def _check_open(self, method: str) -> None:
        if not self._finalizer.alive:
            raise RuntimeError(f"`SharedMemoryWeightTransfer.{method}()` called after `destroy()`.")

    def __enter__(self) -> SharedMemoryWeightTransfer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.destroy()
