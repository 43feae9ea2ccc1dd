"""Run a docs example as a user would run it: its text with a few swaps (the tiny model, two steps), as a script."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1", "TOKENIZERS_PARALLELISM": "false"}


def run_swapped(source: str, swaps: dict[str, str], where: str, folder: Path, timeout: float = 280) -> str:
    """Write `source` with each key of `swaps` (found exactly once, else the example changed) replaced, run it in
    `folder` with the offline environment, and return its stdout; fails with its stderr when it exits non-zero."""
    for old, new in swaps.items():
        assert source.count(old) == 1, f"{where} no longer holds {old!r}: update this test"
        source = source.replace(old, new)
    script = folder / "example.py"
    script.write_text(source)
    done = subprocess.run(
        [sys.executable, str(script)], cwd=folder, env=ENV, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout
