#!/usr/bin/env bash
# The multi-turn environment recipe (configs/number_guess.yaml) in one command: SmolLM2-135M-Instruct's held-out solve
# rate at the number-guessing game, a warm start on games played by bisection (`lightning-grpo sft`), then GRPO with
# `environment_factory` from it, and a table with the solve rate, guesses and turns per game before and after.
# Sets up .venv if needed. Extra arguments go to the recipe (`--sft.*` to the warm start, the rest to the fit).
# See docs/guides/tool_use_recipe.md.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export HF_HUB_OFFLINE=1 TRL_EXPERIMENTAL_SILENCE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m lightning_grpo.cli.recipe --config lightning_grpo/configs/number_guess.yaml \
  --held_out val/rewards/solved "$@"
