#!/usr/bin/env bash
# The tool-use recipe (configs/calculator.yaml) in one command: SmolLM2-135M-Instruct's held-out accuracy with no
# tools, a warm start on calculator-call demonstrations (`lightning-grpo sft`), then GRPO with the tool from it,
# held-out accuracy before and after, and a table with tool calls, failed calls and turns per conversation.
# Sets up .venv if needed. Extra arguments go to the recipe (`--sft.*` to the warm start, the rest to the fit), e.g.
# `./scripts/calculator.sh --sft.num_demonstrations 64 --trainer.max_steps 4`. See docs/guides/tool_use_recipe.md.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export HF_HUB_OFFLINE=1 TRL_EXPERIMENTAL_SILENCE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m lightning_grpo.cli.recipe --config lightning_grpo/configs/calculator.yaml --baseline_without_tools "$@"
