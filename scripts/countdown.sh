#!/usr/bin/env bash
# The countdown recipe (configs/countdown.yaml) in one command: SmolLM2-135M-Instruct's held-out solve rate, a warm
# start on worked countdown demonstrations (`lightning-grpo sft`), then GRPO from it with reasoning-gym's own scorer,
# the solve rate (`val/pass@1`: greedy answers scoring 1.0) before and after, and a summary table.
# Sets up .venv if needed. Extra arguments go to the recipe (`--sft.*` to the warm start, the rest to the fit), e.g.
# `./scripts/countdown.sh --sft.num_demonstrations 16 --trainer.max_steps 8`. See docs/guides/tool_use_recipe.md.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export HF_HUB_OFFLINE=1 TRL_EXPERIMENTAL_SILENCE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m lightning_grpo.cli.recipe --config lightning_grpo/configs/countdown.yaml \
  --held_out val/pass@1 "$@"
