#!/usr/bin/env bash
# Creates .venv (Python 3.11+) with the CPU build of torch and lightning_grpo installed editable, with its dev extra.
# Idempotent: reinstalls only when pyproject.toml changed since the last run.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
stamp=.venv/.lightning_grpo_installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    # torch first and pinned: a bare `torch` requirement pulls a multi-GB CUDA build.
    .venv/bin/pip install --quiet --disable-pip-version-check "torch==2.13.0"
    .venv/bin/pip install --quiet --disable-pip-version-check -e ".[dev]"
    echo "$want" > "$stamp"
fi
