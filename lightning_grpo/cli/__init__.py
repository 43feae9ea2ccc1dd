"""The `lightning-grpo` command (`app`: fit, validate, export, vllm-serve), the main job (`main_job`) and the export
of a checkpoint's policy as a Hugging Face folder (`export`)."""

from .app import DESCRIPTION, TRAINER_DEFAULTS, GRPOLightningCLI, cli, main

__all__ = ["DESCRIPTION", "TRAINER_DEFAULTS", "GRPOLightningCLI", "cli", "main"]
