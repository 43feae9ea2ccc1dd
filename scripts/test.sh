#!/usr/bin/env bash
# The test suite: sets up .venv if needed, then runs pytest (offline, CPU). Extra arguments go to pytest.
# PYTEST_WORKERS=2 runs it on 2 pytest-xdist workers (on 2 cores ~9% faster, each test slower under contention);
# the default, 0, runs it in this one process.
set -euo pipefail
cd "$(dirname "$0")/.."
# the docs site's build and the W&B and MLflow runs are tested too
LIGHTNING_GRPO_EXTRAS=${LIGHTNING_GRPO_EXTRAS:-dev,docs,wandb,mlflow} ./scripts/setup.sh
export HF_HUB_OFFLINE=1 TRL_EXPERIMENTAL_SILENCE=1 TOKENIZERS_PARALLELISM=false
# LIGHTNING_GRPO_TESTS picks the tier: `fast` (the default: everything but the tests marked slow), `slow` (only
# those: real-model and multi-process end-to-end runs of a minute or more), `all`. .ci/run runs fast, then slow.
case "${LIGHTNING_GRPO_TESTS:-fast}" in
    fast) tier=(-m "not slow") ;;
    slow) tier=(-m slow) ;;
    all) tier=() ;;
    *) echo "LIGHTNING_GRPO_TESTS=${LIGHTNING_GRPO_TESTS}: use fast, slow or all" >&2; exit 2 ;;
esac
exec .venv/bin/python -m pytest -n "${PYTEST_WORKERS:-0}" --dist loadgroup "${tier[@]}" "$@"
