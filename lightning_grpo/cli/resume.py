"""The command's check of `--ckpt_path` before anything starts: a whole GRPO checkpoint, of this run."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..pipeline.run_identity import checked_restore
from ..training.checkpoint_io import read_checkpoint

if TYPE_CHECKING:
    from ..datamodule import GRPODataModule

# Lightning resolves these names itself (and warns when "last" finds nothing, then starts a new run).
_NAMED = ("last", "best", "hpc", "registry")


def check_checkpoint_file(ckpt_path: Any) -> dict[str, Any] | None:
    """The checkpoint `ckpt_path` names, checked (see `read_checkpoint`); None for a name Lightning resolves, a
    remote path or a sharded folder."""
    if ckpt_path is None or str(ckpt_path) in _NAMED or "://" in str(ckpt_path):
        return None
    return read_checkpoint(ckpt_path)


def check_resume(ckpt_path: Any, datamodule: GRPODataModule, world_size: int | None) -> None:
    """Refuse, before the fit starts, a checkpoint file that would fail (or silently mislead) the resume.

    Raises:
        ValueError: one line: the file is missing, truncated, corrupt or foreign (see `read_checkpoint`), or it was
            written by a run whose prompts, `seed`, `num_generations` or groups per step differ, or with more `epochs`.
    """
    checkpoint = check_checkpoint_file(ckpt_path)
    if checkpoint is None:
        return
    state = checkpoint.get(type(datamodule).__qualname__) or {}
    current = datamodule.run_identity(world_size)
    checked_restore(state, current, allow_changed=datamodule.options.data.allow_changed_data)
