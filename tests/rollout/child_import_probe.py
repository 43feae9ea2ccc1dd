"""Run by `test_child_imports.py` in a fresh interpreter: imports what the rollout child imports (the forkserver's
preload, the worker's child entry, the replica and reward workers, every rollout module), then runs every import
statement in the package's loaded modules, in their functions too (those under `TYPE_CHECKING` excepted), until nothing
new loads. Prints, as JSON, the entry modules, which modules are loaded, and whether CUDA was initialised."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import pkgutil
import sys
from pathlib import Path
from types import ModuleType

import torch

import lightning_grpo.rollout
from lightning_grpo.rollout.start_method import PRELOAD

LIGHTNING = ("lightning", "pytorch_lightning", "lightning_fabric")


def child_entries() -> list[str]:
    entries = [
        *PRELOAD,
        "lightning_grpo.rollout.worker",  # `_child_entry`, what the forked child runs
        "lightning_grpo.rollout.replica_worker",
        "lightning_grpo.rollout.reward_worker",
    ]
    return entries + [f"lightning_grpo.rollout.{m.name}" for m in pkgutil.iter_modules(lightning_grpo.rollout.__path__)]


def imported(statement: ast.Import | ast.ImportFrom, package: str) -> list[tuple[str, list[str]]]:
    """The module a statement loads and the names it takes from it: `from a import b` gives `("a", ["b"])`."""
    if isinstance(statement, ast.Import):
        return [(alias.name, []) for alias in statement.names]
    base = importlib.util.resolve_name("." * statement.level + (statement.module or ""), package)
    return [(base, [alias.name for alias in statement.names])]


def import_statements(path: Path) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of `path` that can run (anywhere but under `if TYPE_CHECKING:`)."""
    tree = ast.parse(path.read_text())
    type_checking = {
        id(child)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for statement in node.body
        for child in ast.walk(statement)
    }
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        and id(node) not in type_checking
        and getattr(node, "module", None) != "__future__"
    ]


def run_imports(module: ModuleType) -> None:
    """Run `module`'s import statements, as its functions would when called."""
    path = getattr(module, "__file__", None)
    if not path or not path.endswith(".py"):
        return
    package = module.__name__ if path.endswith("__init__.py") else module.__name__.rpartition(".")[0]
    for statement in import_statements(Path(path)):
        for base, names in imported(statement, package):
            try:
                parent = importlib.import_module(base)
            except ImportError:
                if base.startswith("lightning_grpo"):
                    raise
                continue  # an optional library this machine lacks (vLLM): the child never loads it here either
            for name in names if base.startswith("lightning_grpo") else []:
                if hasattr(parent, "__path__") and importlib.util.find_spec(f"{base}.{name}"):
                    importlib.import_module(f"{base}.{name}")
                else:
                    getattr(parent, name)  # a facade's lazy name loads its module


def main() -> None:
    entries = child_entries()
    for name in entries:
        importlib.import_module(name)
    done: set[str] = set()
    while todo := [name for name in list(sys.modules) if name.startswith("lightning_grpo") and name not in done]:
        for name in todo:
            done.add(name)
            run_imports(sys.modules[name])
    loaded = sorted(sys.modules)
    report = {
        "entries": entries,
        "package": [name for name in loaded if name.startswith("lightning_grpo")],
        "lightning": [name for name in loaded if name.split(".")[0] in LIGHTNING],
        "cuda_initialized": torch.cuda.is_initialized(),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
