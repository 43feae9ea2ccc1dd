#!/usr/bin/env bash
# The main job: GRPO on synthetic arithmetic with SmolLM2-135M-Instruct on CPU. Sets up .venv if needed.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
echo "The main job lands with the Lightning integration (issue 6/7); the environment is ready."
