#!/usr/bin/env bash
# The test suite: sets up .venv if needed, then runs pytest (offline, CPU). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export HF_HUB_OFFLINE=1 TRL_EXPERIMENTAL_SILENCE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest "$@"
