#!/usr/bin/env bash
# The test suite: sets up .venv if needed, then runs pytest (offline, CPU) on $PYTEST_WORKERS pytest-xdist workers
# (default 2; 0 runs in this process). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export HF_HUB_OFFLINE=1 TRL_EXPERIMENTAL_SILENCE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -n "${PYTEST_WORKERS:-2}" --dist loadgroup "$@"
