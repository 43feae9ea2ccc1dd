"""The layers of the package as docs/concepts/layout.md declares them, read from its table (the one place they are
written down): which layer each folder and top-level file is in."""

from __future__ import annotations

import re
from pathlib import Path

LAYOUT = Path(__file__).resolve().parents[2] / "docs" / "concepts" / "layout.md"
FACADE = "__init__.py"  # the package's own `__init__.py`, the lazy public facade


def read_layers(layout: Path = LAYOUT) -> dict[str, int]:
    """The layer of each folder and top-level file the layout table lists: `{"models/": 3, "rewards.py": 8, ...}`.

    A table row is `| 3 | `models/` | what it holds |`: the layer, then the folders (`name/`) and files (`name.py`) in
    backticks.

    Raises:
        ValueError: an entry listed twice.
    """
    layers: dict[str, int] = {}
    for line in layout.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].isdigit():
            for entry in re.findall(r"`([^`]+)`", cells[1]):
                if entry in layers:
                    raise ValueError(f"{layout.name} lists {entry} in layers {layers[entry]} and {cells[0]}")
                layers[entry] = int(cells[0])
    return layers


def entry_of(module: str, folders: set[str]) -> str:
    """The table entry a module of the installed package belongs to: `lightning_grpo.rollout.loop` -> `rollout/`,
    `lightning_grpo.rewards` -> `rewards.py`, `lightning_grpo` -> `__init__.py`; `folders` are the folder entries."""
    parts = module.split(".")
    if len(parts) == 1:
        return FACADE
    return f"{parts[1]}/" if f"{parts[1]}/" in folders else f"{parts[1]}.py"
