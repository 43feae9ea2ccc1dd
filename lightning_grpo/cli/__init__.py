"""The `lightning-grpo` command (`app`: fit, validate, export, vllm-serve; `lightning_cli`: the LightningCLI of fit
and validate), the main job (`main_job`) and the export of a checkpoint's policy as a Hugging Face folder
(`export`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._imports import lazy_exports
from .app import DESCRIPTION, SUBCOMMANDS, cli, main

# The LightningCLI side imports torch and Lightning: loaded on first use, so `lightning-grpo --help` does without.
__getattr__, __dir__ = lazy_exports(
    __name__, {"GRPOLightningCLI": "lightning_cli", "TRAINER_DEFAULTS": "lightning_cli"}
)

__all__ = ["DESCRIPTION", "SUBCOMMANDS", "TRAINER_DEFAULTS", "GRPOLightningCLI", "cli", "main"]

if TYPE_CHECKING:
    from .lightning_cli import TRAINER_DEFAULTS, GRPOLightningCLI
