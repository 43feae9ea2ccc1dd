"""The public API: every exported name resolves, and importing the package does not import torch (what the rollout
child imports is `tests/rollout/test_child_imports.py`'s)."""

from __future__ import annotations

import subprocess
import sys

import lightning_grpo


def test_every_exported_name_resolves():
    missing = [name for name in lightning_grpo.__all__ if getattr(lightning_grpo, name, None) is None]
    assert not missing


def test_callbacks_subpackage_exports():
    from lightning_grpo import callbacks

    for name in callbacks.__all__:
        assert getattr(callbacks, name) is not None


def test_importing_the_package_is_light():
    code = "import sys, lightning_grpo.rollout.reward_pool; print('torch' in sys.modules, 'lightning' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["False", "False"]
