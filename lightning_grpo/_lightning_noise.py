"""The one place the package silences warnings: each a Lightning note that says nothing a GRPO user can act on,
filtered by its exact message (and module) only when the situation it describes is the intended one."""

from __future__ import annotations

import warnings


def ignore_leafspec_deprecation() -> None:
    """Lightning 2.6 wraps every loader it is handed in a `CombinedLoader` built with torch's deprecated `LeafSpec`:
    a FutureWarning addressed to Lightning, printed at each fit and validation."""
    warnings.filterwarnings(
        "ignore",
        message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        category=FutureWarning,
        module=r"lightning\.pytorch\.utilities\._pytree",
    )


def ignore_empty_val_loader() -> None:
    """No held-out prompts means no validation, on purpose: Lightning's note about an empty loader is noise."""
    warnings.filterwarnings(
        "ignore",
        message=r"Total length of `list` across ranks is zero",
        module=r"lightning\.pytorch\.utilities\.data",
    )


def ignore_manual_optimization_checkpoints() -> None:
    """GRPOModule optimizes manually by design and a checkpoint holds the weights after the step it counts, which is
    what a resume needs: Lightning's warning about that, printed at every save, says nothing to act on."""
    warnings.filterwarnings("ignore", message=r"Using ModelCheckpoint with manual optimization and every_n_train")
