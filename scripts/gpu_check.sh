#!/usr/bin/env bash
# The GPU acceptance check (scripts/gpu_check.py says what it checks): one line per step, PASS, FAIL or SKIP with the
# reason; exit 1 on any FAIL. Without CUDA it says so in one line and exits 0. Arguments go to gpu_check.py
# (--steps attention,fit; --device cpu rehearses the steps on the CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
export TRL_EXPERIMENTAL_SILENCE=1 TOKENIZERS_PARALLELISM=false
# gpu_check.py skips the steps it has no time left for; this bounds a step that hangs (its vLLM server goes with it)
exec timeout --kill-after=30 600 .venv/bin/python scripts/gpu_check.py "$@"
