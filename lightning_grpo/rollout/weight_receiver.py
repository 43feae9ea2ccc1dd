"""The generator's side of the shared-memory weight sync, and the block's format both sides read.

The trainer's side is `lightning_grpo.weights.shared_memory.SharedMemoryWeightTransfer`; it writes one shared-memory
block: a 64-byte header (a magic number, the sequence number of the last publish, its model version, a valid flag), a
table of the sequence number each tensor was last written under, then every tensor at a 64-byte aligned offset
(`build_manifest` lays them out). `SharedMemoryWeightReceiver` is what the rollout child holds: a small picklable
object (the block's name, the lock file's path and the manifest) that the embedded generator polls between decode
steps, copying under a shared `flock` only the tensors written since its last copy.

This module is imported by the rollout child, so it imports torch and nothing of the trainer's side.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import torch

log = logging.getLogger(__name__)

HEADER_BYTES = 64
ALIGN = 64
MAGIC = 0x4C47_5250_4F57_5431  # marks a block written by `SharedMemoryWeightTransfer`
# header slots (int64)
H_MAGIC, H_SEQ, H_VERSION, H_VALID = 0, 1, 2, 3


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Where one tensor lives in the shared block."""

    name: str  # parameter name, as in `model.named_parameters()`
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"
    offset: int  # byte offset from the start of the block

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())

    @property
    def nbytes(self) -> int:
        return self.numel * self.torch_dtype.itemsize


@dataclass(frozen=True, slots=True)
class Manifest:
    """Every tensor's place in the block, the tied names sent under another name, and the block's size."""

    specs: tuple[TensorSpec, ...]
    aliases: dict[str, str]  # tied name -> the name whose tensor it shares (sent once, under that name)
    size: int  # bytes of the whole block, header included


def table_bytes(count: int) -> int:
    """Bytes of the written-at table (one int64 per tensor), rounded up to the alignment."""
    return -(-count * 8 // ALIGN) * ALIGN


def build_manifest(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Manifest:
    """The block's layout for these tensors: each at an aligned offset, a tensor that shares another's storage (a
    tied `lm_head`) as an alias of the first name.

    Raises:
        ValueError: no tensors, or a name twice.
    """
    named_tensors = list(named_tensors)
    specs: list[TensorSpec] = []
    aliases: dict[str, str] = {}
    owner_of: dict[int, str] = {}
    names: set[str] = set()
    keep_alive = []  # so that id() of a temporary cannot be reused by the next tensor
    offset = HEADER_BYTES + table_bytes(len(named_tensors))  # the table has room for every name, tied ones too
    for name, tensor in named_tensors:
        keep_alive.append(tensor)
        if name in names:
            raise ValueError(f"`SharedMemoryWeightTransfer` got the tensor name {name!r} twice. Names must be unique.")
        names.add(name)
        if id(tensor) in owner_of:
            aliases[name] = owner_of[id(tensor)]
            continue
        owner_of[id(tensor)] = name
        spec = TensorSpec(name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."), offset)
        specs.append(spec)
        offset += -(-spec.nbytes // ALIGN) * ALIGN
    if not specs:
        raise ValueError("`SharedMemoryWeightTransfer` got no tensors. Pass the model whose weights you will send.")
    return Manifest(tuple(specs), aliases, offset)


class Block:
    """An open shared-memory block with tensor views over its header and its tensors."""

    def __init__(self, shm: shared_memory.SharedMemory, manifest: Manifest) -> None:
        self.shm = shm
        self.header = torch.frombuffer(shm.buf, dtype=torch.int64, count=HEADER_BYTES // 8)
        # written_at[i]: the sequence number under which specs[i] was last written (0: never)
        self.written_at = torch.frombuffer(shm.buf, dtype=torch.int64, count=len(manifest.specs), offset=HEADER_BYTES)
        self.views = {spec.name: _view(shm, spec) for spec in manifest.specs}
        self.index = {spec.name: i for i, spec in enumerate(manifest.specs)}

    def close(self) -> None:
        # Views export the mmap's buffer; they must go before the mmap can close.
        self.header = None
        self.written_at = None
        self.views = {}
        try:
            self.shm.close()
        except BufferError:
            log.warning("Shared-memory block %s is still referenced; it is unmapped at exit.", self.shm.name)


def _view(shm: shared_memory.SharedMemory, spec: TensorSpec) -> torch.Tensor:
    if spec.numel == 0:
        return torch.empty(spec.shape, dtype=spec.torch_dtype)
    flat = torch.frombuffer(shm.buf, dtype=spec.torch_dtype, count=spec.numel, offset=spec.offset)
    return flat.view(spec.shape)


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst[...] = src`: a one-thread memcpy when the layouts match, else a (casting, cross-device) `copy_`.

    torch's multi-threaded copy is no faster (memory-bound) and stalls when the cores are busy, which they are while
    a trainer and a generator share them.
    """
    plain = (torch.Tensor, torch.nn.Parameter)  # not a DTensor: its data_ptr is the local shard's
    if (
        type(src) in plain
        and src.device.type == "cpu"
        and src.dtype == dst.dtype
        and src.is_contiguous()
        and dst.is_contiguous()
    ):
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.nbytes)  # releases the GIL
    else:
        with torch.no_grad():
            dst.copy_(src)


def try_flock(fd: int, mode: int, timeout_s: float | None) -> bool:
    """Take an flock; `timeout_s=None` tries once. Returns whether it was taken."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if deadline is None or time.monotonic() >= deadline:
                return False
            time.sleep(0.001)


class SharedMemoryWeightReceiver:
    """Generator side of `SharedMemoryWeightTransfer`: copies each published sync into the generator's model.

    It pickles as three small values (block name, lock path, manifest) and attaches to the block on first use, so
    it can travel to a spawned child in any way. One receiver serves one model; `EmbeddedGenerator` polls it before
    each generate batch. It must be used in a process that the trainer started with `multiprocessing` (or in the
    trainer's own process): on Python < 3.13 attaching registers the block with the resource tracker, which the
    spawned child shares with the trainer.
    """

    def __init__(self, block_name: str, lock_path: str, manifest: Manifest) -> None:
        self.block_name = block_name
        self.lock_path = lock_path
        self._manifest = manifest
        self._block: Block | None = None
        self._lock_fd: int | None = None
        self._applied_seq = 0
        self._targets: tuple[int, list[tuple[int, torch.Tensor, torch.Tensor]]] | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.block_name, self.lock_path, self._manifest))

    def has_update(self) -> bool:
        """Whether a sync was published that this receiver has not applied yet (it may still be locked)."""
        return int(self._attach().header[H_SEQ]) != self._applied_seq

    def poll(self, model: torch.nn.Module) -> int | None:
        """Copy the newest published weights into `model` if there are new ones and the trainer is not writing.

        Never waits for the trainer: when it holds the lock the copy is left for the next poll.

        Returns:
            The version of the weights now in `model`, or None when nothing was copied.

        Raises:
            ValueError: `model` lacks a tensor of the manifest or has it in another shape (each named).
            RuntimeError: the trainer's block no longer exists.
        """
        block = self._attach()
        if int(block.header[H_SEQ]) == self._applied_seq:
            return None
        lock_fd = self._lock_fd  # opened by `_attach`, with the block
        if lock_fd is None or not try_flock(lock_fd, fcntl.LOCK_SH, None):
            return None
        try:
            seq, version, valid = (int(block.header[i]) for i in (H_SEQ, H_VERSION, H_VALID))
            if seq == self._applied_seq or not valid:
                return None
            written_at = block.written_at.tolist()
            for index, param, view in self._pairs(model, block):
                if written_at[index] > self._applied_seq:  # written since this receiver's last copy
                    copy_into(param.data, view)
            self._applied_seq = seq
            return version
        finally:
            fcntl.flock(lock_fd, fcntl.LOCK_UN)

    def close(self) -> None:
        """Unmap the block and close the lock file in this process (the trainer unlinks them)."""
        self._targets = None
        if self._block is not None:
            self._block.close()
            self._block = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _attach(self) -> Block:
        if self._block is not None:
            return self._block
        kwargs = {"track": False} if sys.version_info >= (3, 13) else {}
        lock_fd = None
        try:
            lock_fd = os.open(self.lock_path, os.O_RDWR)
            shm = shared_memory.SharedMemory(name=self.block_name, **kwargs)
        except FileNotFoundError as error:
            if lock_fd is not None:
                os.close(lock_fd)
            raise RuntimeError(
                f"The weight receiver cannot find shared-memory block {self.block_name!r} or its lock file "
                f"{self.lock_path!r}: the trainer's `SharedMemoryWeightTransfer` was destroyed, or runs on another "
                "machine. Create the receiver with `transfer.receiver()` while the transfer is alive."
            ) from error
        self._lock_fd = lock_fd
        block = Block(shm, self._manifest)
        if int(block.header[H_MAGIC]) != MAGIC:
            block.close()
            raise RuntimeError(
                f"Shared-memory block {self.block_name!r} was not written by SharedMemoryWeightTransfer."
            )
        self._block = block
        return block

    def _pairs(self, model: torch.nn.Module, block: Block) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        if self._targets is not None and self._targets[0] == id(model):
            return self._targets[1]
        params = dict(model.named_parameters(remove_duplicate=False))
        pairs, problems = [], []
        for index, spec in enumerate(self._manifest.specs):
            param = params.get(spec.name)
            if param is None:
                problems.append(f"{spec.name!r} is missing")
            elif tuple(param.shape) != spec.shape:
                problems.append(f"{spec.name!r} has shape {tuple(param.shape)}, the trainer sends {spec.shape}")
            else:
                pairs.append((index, param, block.views[spec.name]))
        if problems:
            raise ValueError(
                f"The generator's model does not match the weights the trainer sends: {'; '.join(problems[:4])}"
                f"{' ...' if len(problems) > 4 else ''}. Build it from the trainer's config (`PolicySpec.from_model`)."
            )
        self._targets = (id(model), pairs)
        return pairs
