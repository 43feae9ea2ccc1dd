"""The `lightning-grpo` command (`app`: the dispatcher of fit, validate, export, vllm-serve and sft; `lightning_cli`:
the LightningCLI of fit and validate; `parsing`: the parser whose errors name the closest valid choice), the main job
(`main_job`) and the export of a checkpoint's policy as a Hugging Face folder (`export`).

`lightning-grpo --help` imports only `app` and `parsing`: the LightningCLI side (torch, Lightning) loads on first use.
"""

from __future__ import annotations

from .app import SUBCOMMANDS, cli, main

__all__ = ["SUBCOMMANDS", "cli", "main"]
