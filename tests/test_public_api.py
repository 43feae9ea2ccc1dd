"""The public API: every exported name resolves, and importing the package does not import torch."""

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


TRAINER_SIDE = (
    "lightning",
    "lightning_grpo.callbacks",
    "lightning_grpo.datamodule",
    "lightning_grpo.module",
    "lightning_grpo.pipeline",
    "lightning_grpo.scoring",
    "lightning_grpo.pipeline.session",
    "lightning_grpo.training.sharding",
    "lightning_grpo.weights.sync",
)


def test_the_rollout_package_loads_neither_lightning_nor_the_trainer_side():
    """Everything the rollout child imports (its loop, worker, generator, reward pool and workers, the generator's
    side of the shared-memory transfer) leaves Lightning and the trainer-side modules unloaded."""
    import pkgutil

    import lightning_grpo.rollout

    modules = [f"lightning_grpo.rollout.{m.name}" for m in pkgutil.iter_modules(lightning_grpo.rollout.__path__)]
    modules.append("lightning_grpo.weights.shared_memory")
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        f"print([m for m in sys.modules if m in {TRAINER_SIDE!r} or m.startswith({tuple(p + '.' for p in TRAINER_SIDE)!r})])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "lightning_grpo.rollout.loop" in modules and len(modules) >= 10
    assert out.stdout.strip() == "[]", out.stdout
