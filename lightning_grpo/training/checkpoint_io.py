"""Checkpoint files a kill cannot damage, and the check of a checkpoint given to `--ckpt_path` before a run starts.

`AtomicCheckpointIO` writes each checkpoint to a temporary file in the same folder, fsyncs it and renames it over
the target, so a process killed at any moment of a save leaves the previous file whole (Lightning's
`TorchCheckpointIO` truncates the target and writes into it). `GRPOModule.setup` installs it in place of Lightning's
default; a checkpoint IO you configure (`Trainer(plugins=...)`) is kept.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import TorchCheckpointIO
from typing_extensions import override

from .policy import CHECKPOINT_KEY

_TEMP_MARK = ".tmp-"


class AtomicCheckpointIO(TorchCheckpointIO):
    """`TorchCheckpointIO` whose local saves are atomic: temporary file, fsync, rename, fsync of the folder.

    A save killed midway leaves the previous checkpoint as it was and a `.NAME.tmp-PID` file, which the next save
    to the same path removes. Remote paths (`s3://...`) are saved as Lightning saves them.
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        for stale in path.parent.glob(f".{path.name}{_TEMP_MARK}*"):
            stale.unlink(missing_ok=True)  # left by a save that was killed
        temporary = path.with_name(f".{path.name}{_TEMP_MARK}{os.getpid()}")
        try:
            with temporary.open("wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temporary, path)
            _fsync_folder(path.parent)
        finally:
            temporary.unlink(missing_ok=True)


def _fsync_folder(folder: Path) -> None:
    """Make the rename durable: a crash right after it must not bring back the old directory entry."""
    with contextlib.suppress(OSError):  # some file systems cannot open a folder
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def use_atomic_checkpoints(strategy: Any) -> None:
    """Give `strategy` an `AtomicCheckpointIO` when it has Lightning's default `TorchCheckpointIO`."""
    if type(getattr(strategy, "checkpoint_io", None)) is TorchCheckpointIO:
        strategy.checkpoint_io = AtomicCheckpointIO()


def read_checkpoint(path: str | Path, option: str = "--ckpt_path") -> dict[str, Any] | None:
    """Load `path` (memory-mapped, on the CPU) and check it is a whole `GRPOModule` training checkpoint; None for a
    sharded checkpoint folder, which the strategy checks itself. Reading it whole for the checksums costs about a
    second per GB.

    Raises:
        ValueError: one line naming the file and what is wrong: missing, truncated or corrupt, not a Lightning
            checkpoint, not written by a `GRPOModule`, or saved without the training state (`save_weights_only`).
    """
    path = Path(path)
    where = f"`{option} {path}`"
    if path.is_dir():
        return None
    if not path.is_file():
        raise ValueError(f"{where}: no such file. Give the path of a checkpoint a fit wrote (e.g. preempted.ckpt).")
    if not zipfile.is_zipfile(path):
        raise ValueError(
            f"{where}: not a PyTorch checkpoint ({path.stat().st_size} bytes, no zip archive at its end): the file "
            "is truncated (a save that was cut off) or another kind of file. Resume from an earlier checkpoint."
        )
    with zipfile.ZipFile(path) as archive:
        damaged = archive.testzip()  # reads every record: torch.load does not check the checksums
    if damaged is not None:
        raise ValueError(
            f"{where}: the checkpoint is corrupt (record {damaged} fails its checksum). Resume from an earlier one."
        )
    try:
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except pickle.UnpicklingError as error:
        if "weights_only" not in str(error).lower().replace(" ", "_"):
            raise ValueError(f"{where}: the checkpoint is corrupt ({_first_line(error)}).") from error
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except Exception as error:
        raise ValueError(
            f"{where}: the checkpoint is corrupt ({type(error).__name__}: {_first_line(error)})."
        ) from error
    problem = _not_resumable(checkpoint)
    if problem:
        raise ValueError(f"{where}: {problem}")
    return checkpoint


def _not_resumable(checkpoint: Any) -> str | None:
    if (
        not isinstance(checkpoint, dict)
        or "state_dict" not in checkpoint
        or "pytorch-lightning_version" not in checkpoint
    ):
        return "not a Lightning checkpoint (it has no `state_dict` and `pytorch-lightning_version`)."
    if CHECKPOINT_KEY not in checkpoint:
        return "a Lightning checkpoint, but not one a GRPOModule wrote (no `lightning_grpo_policy` record): start a new run."
    if "loops" not in checkpoint or "optimizer_states" not in checkpoint:
        return (
            "it holds weights only (`ModelCheckpoint(save_weights_only=True)`), not the training state a resume "
            "needs: resume from a full checkpoint, or load the weights into a new run."
        )
    return None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
