"""Import paths of modules that moved into folders: they keep working for one release, with a `FutureWarning`.

`import lightning_grpo.loss` (or a YAML `class_path: lightning_grpo.loss_options.LossOptions`, or a pickle that
names the old module) gets the very module object at the new path, so classes and functions compare identical
whichever path loaded them. `python -m` with an old path runs the module at its new path.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import CodeType, ModuleType

#: old import path -> the path it moved to
MOVED_MODULES = {
    f"lightning_grpo.{old}": f"lightning_grpo.{new}"
    for old, new in {
        "attention": "training.attention",
        "completions": "training.completions",
        "loss": "training.loss",
        "loss_options": "training.loss_options",
        "loss_stats": "training.loss_stats",
        "policy": "training.policy",
        "reference": "training.reference",
        "replay": "training.replay",
        "selected_logprobs": "training.selected_logprobs",
        "sharding": "training.sharding",
        "step_metrics": "training.step_metrics",
        "threads": "training.threads",
        "validation_metrics": "validation.metrics",
        "smollm2": "models.smollm2",
        "options": "data.options",
        "tooling": "data.tooling",
        "session": "pipeline.session",
        "metrics": "pipeline.metrics",
        "main_job": "cli.main_job",
        "export": "cli.export",
    }.items()
}
"""Old paths whose names are packages now (`lightning_grpo.models`, `.cli`, `.data`, `.validation`) re-export or
hold what they held, so they need no entry here."""


def _warn(old: str, new: str) -> None:
    warnings.warn(
        f"`{old}` moved to `{new}`; the old import path will be removed in the next release.",
        FutureWarning,
        stacklevel=3,
    )


class _MovedModuleLoader(importlib.abc.Loader):
    """Loads an old path as the module at its new path (the same object, registered under both names)."""

    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        _warn(spec.name, self.new)
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:
        """The module at the new path is already executed."""

    def get_code(self, fullname: str) -> CodeType | None:
        """The new module's code, for `python -m <old path>`."""
        _warn(fullname, self.new)
        spec = importlib.util.find_spec(self.new)
        return spec.loader.get_code(self.new)


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds the old import paths of `MOVED_MODULES`."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = MOVED_MODULES.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _MovedModuleLoader(new))


def install() -> None:
    """Adds the finder once (a re-import of the package does not add a second)."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
