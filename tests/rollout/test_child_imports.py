"""What the rollout child imports: in a fresh interpreter, the forkserver's preload, the worker's child entry, the
replica worker, the reward worker and every rollout module, with every import their functions would run (lazy
imports included, to a fixed point). None of it may load Lightning, a module of a layer above `rollout/` (as
docs/concepts/layout.md declares them), or initialise CUDA: the child stays light and CUDA-free."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from helpers.layout import entry_of, read_layers

PROBE = Path(__file__).with_name("child_import_probe.py")


def test_the_rollout_child_imports_no_lightning_no_higher_layer_and_leaves_cuda_alone():
    out = subprocess.run([sys.executable, str(PROBE)], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert "lightning_grpo.rollout.loop" in loaded["entries"] and len(loaded["entries"]) > 20
    assert "lightning_grpo.rollout.generator" in loaded["package"]  # the closure reached the embedded generator
    layers = read_layers()
    folders = {entry for entry in layers if entry.endswith("/")}
    ceiling = layers["rollout/"]
    # Importing any submodule runs the package's own `__init__.py`, the facade, which imports nothing at load.
    above = [
        f"{name} (layer {layers.get(entry_of(name, folders))})"
        for name in loaded["package"]
        if name != "lightning_grpo" and layers.get(entry_of(name, folders), ceiling + 1) > ceiling
    ]
    assert not above, f"the rollout child loads modules above rollout/ (layer {ceiling}): {above}"
    assert loaded["lightning"] == [], f"the rollout child loads Lightning: {loaded['lightning'][:5]}"
    assert loaded["cuda_initialized"] is False
