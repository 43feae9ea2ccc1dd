"""The tree explains the architecture: module sizes, what the package's top level holds, no import cycles (the
package, its callbacks and the benchmarks), and every old import path of a moved module still working."""

from __future__ import annotations

import ast
import importlib
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "lightning_grpo"
SOURCES = [PACKAGE, ROOT / "callbacks", ROOT / "benchmarks"]
MAX_LINES = 600
#: The two files every user reads first: the hooks and the user-facing arguments, the rest delegated.
ENTRY_POINTS = {"module.py": 500, "datamodule.py": 500}
#: What a user imports first, the package's private plumbing, and nothing else.
TOP_LEVEL = {
    "__init__.py", "_imports.py", "_lightning_noise.py", "_moved.py", "_trl.py",
    "contract.py", "datamodule.py", "module.py", "rewards.py", "tools.py",
}  # fmt: skip


def python_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def module_name(path: Path) -> str:
    """The import name of a file: `lightning_grpo.x.y`, `lightning_grpo.callbacks.x`, or `benchmarks.x`."""
    relative = path.relative_to(ROOT).with_suffix("")
    parts = list(relative.parts)
    if parts[0] == "callbacks":
        parts = ["lightning_grpo", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imported_at_load(path: Path) -> set[str]:
    """Modules `path` imports when it is loaded: top-level imports, including those under `if`/`try`, but not under
    `if TYPE_CHECKING:` nor inside functions (lazy imports run when called, after every module has loaded)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def local(imported: str) -> str:
        """Benchmarks import each other by file name (`python benchmarks/x.py` puts their folder on sys.path)."""
        in_benchmarks = path.is_relative_to(ROOT / "benchmarks")
        return (
            f"benchmarks.{imported}"
            if in_benchmarks and (ROOT / "benchmarks" / f"{imported}.py").exists()
            else imported
        )

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
            elif isinstance(node, ast.If | ast.Try):
                visit(node.body)
                visit(getattr(node, "orelse", []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
            elif isinstance(node, ast.Import):
                found.update(local(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                else:
                    base = local(base)
                found.add(base)
                found.update(f"{base}.{alias.name}" for alias in node.names)

    visit(ast.parse(path.read_text()).body)
    return found


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for root in SOURCES for p in python_files(root)}
    graph = {}
    for name, path in files.items():
        targets = {t for t in imported_at_load(path) if t in files and t != name}
        graph[name] = targets
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph`, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_module_is_over_600_lines_and_the_entry_points_stay_short():
    too_long = {}
    for root in SOURCES:
        for path in python_files(root):
            lines = len(path.read_text().splitlines())
            limit = ENTRY_POINTS.get(path.name, MAX_LINES) if path.parent == PACKAGE else MAX_LINES
            if lines > limit:
                too_long[str(path.relative_to(ROOT))] = (lines, limit)
    assert not too_long, f"modules over their line limit (lines, limit): {too_long}"


def test_the_top_level_holds_only_what_users_import_first_and_the_rest_lives_in_folders():
    modules = {p.name for p in PACKAGE.glob("*.py")}
    assert modules == TOP_LEVEL, f"unexpected top-level modules {sorted(modules - TOP_LEVEL)} (put them in a folder)"
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    expected = {"cli", "configs", "data", "models", "pipeline", "rollout", "scoring", "serving", "training"}
    assert folders >= expected | {"validation", "weights"}


def test_there_is_no_import_cycle_in_the_package_its_callbacks_or_the_benchmarks():
    graph = import_graph()
    assert len(graph) > 100  # the graph covers the tree, not a handful of files
    assert "lightning_grpo.training.loss" in graph["lightning_grpo.module"]
    assert "benchmarks.common" in graph["benchmarks.generation"]
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("old", sorted(__import__("lightning_grpo._moved", fromlist=["x"]).MOVED_MODULES))
def test_an_old_import_path_warns_and_gives_the_module_at_its_new_path(old):
    from lightning_grpo._moved import MOVED_MODULES

    new = importlib.import_module(MOVED_MODULES[old])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import sys

        sys.modules.pop(old, None)
        module = importlib.import_module(old)
    assert module is new
    assert any(issubclass(w.category, FutureWarning) and MOVED_MODULES[old] in str(w.message) for w in caught)
