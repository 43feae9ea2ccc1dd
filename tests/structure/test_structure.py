"""The tree explains the architecture: the layers that docs/concepts/layout.md declares (every import, wherever it is
written, goes to the importer's own layer or a lower one; no import circle), module sizes, and no import cycle in the
benchmarks.

The layers are read from the table in docs/concepts/layout.md, the one place they are written down."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers.layout import FACADE, LAYOUT, read_layers

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "lightning_grpo"
MAX_LINES = 600
#: The two files every user reads first: the hooks and the user-facing arguments, the rest delegated.
ENTRY_POINTS = {"module.py": 390, "datamodule.py": 460}


def python_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


@dataclass(frozen=True, slots=True)
class Import:
    """One import statement's target, as a module of the tree."""

    importer: str
    imported: str
    line: int
    type_checking: bool  # under `if TYPE_CHECKING:`


def module_name(path: Path, root: Path) -> str:
    """The import name of a file: `lightning_grpo.x.y`, `lightning_grpo.callbacks.x`, or `benchmarks.x`."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[0] == "callbacks":
        parts = ["lightning_grpo", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def package_files(root: Path) -> dict[str, Path]:
    """Every module of the package under `root` (`lightning_grpo/` and the callbacks installed into it)."""
    folders = [root / "lightning_grpo", root / "callbacks"]
    return {module_name(path, root): path for folder in folders if folder.is_dir() for path in python_files(folder)}


def table_entry(path: Path, root: Path) -> str:
    """The layout table's entry a file belongs to: its top folder (`rollout/`), or its own name (`rewards.py`)."""
    parts = path.relative_to(root).parts
    if parts[0] == "callbacks":
        return "callbacks/"
    return f"{parts[1]}/" if len(parts) > 2 else parts[1]


def _statements(path: Path, *, in_functions: bool = True) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement of `path`, wherever it is (module top, functions, `if`, `try`), and whether it sits
    under `if TYPE_CHECKING:`; with `in_functions=False`, those that run when the file loads."""
    found = []
    functions = () if in_functions else (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)

    def visit(node: ast.AST, type_checking: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, functions):
                continue
            if isinstance(child, ast.Import | ast.ImportFrom):
                found.append((child, type_checking))
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for statement in child.body:
                    visit(ast.Module(body=[statement], type_ignores=[]), True)
                for statement in child.orelse:
                    visit(ast.Module(body=[statement], type_ignores=[]), type_checking)
            else:
                visit(child, type_checking)

    visit(ast.parse(path.read_text()), False)
    return found


def _targets(statement: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[tuple[str, str | None]]:
    """`(module, name)` pairs a statement imports from: `from a.b import c` gives `("a.b", "c")`."""
    if isinstance(statement, ast.Import):
        return [(alias.name, None) for alias in statement.names]
    base = statement.module or ""
    if statement.level:
        package = module if is_package else module.rpartition(".")[0]
        anchor = package.split(".")[: len(package.split(".")) - statement.level + 1]
        base = ".".join([*anchor, base] if base else anchor)
    return [(base, alias.name) for alias in statement.names]


def facade_exports(files: dict[str, Path]) -> dict[str, dict[str, str]]:
    """For each package `__init__.py`: the module that defines each name it imports (its lazy exports are imported under
    `TYPE_CHECKING` for the type checkers), so that `from package import name` counts as importing that module."""
    exports: dict[str, dict[str, str]] = {}
    for module, path in files.items():
        if path.name == "__init__.py":
            names = exports.setdefault(module, {})
            for statement, _ in _statements(path):
                for base, name in _targets(statement, module, is_package=True):
                    if name is not None and base in files:
                        names[name] = f"{base}.{name}" if f"{base}.{name}" in files else base
    return exports


def imports(files: dict[str, Path]) -> list[Import]:
    """Every import of a module of the tree by a module of the tree (the same module excepted)."""
    exports = facade_exports(files)
    found = []
    for module, path in files.items():
        for statement, type_checking in _statements(path):
            for base, name in _targets(statement, module, is_package=path.name == "__init__.py"):
                if name is not None and f"{base}.{name}" in files:
                    target = f"{base}.{name}"
                elif name is not None and name in exports.get(base, {}):
                    target = exports[base][name]
                else:
                    target = base
                if target in files and target != module:
                    found.append(Import(module, target, statement.lineno, type_checking))
    return found


def upward_imports(root: Path, layers: dict[str, int]) -> list[str]:
    """Every import of a higher layer than the importer's, named: `a imports b (layer 5 above 3) at file:line`."""
    files = package_files(root)
    layer = {module: layers.get(table_entry(path, root)) for module, path in files.items()}
    return [
        f"{edge.importer} imports {edge.imported} (layer {layer[edge.imported]} above {layer[edge.importer]}) at "
        f"{files[edge.importer].relative_to(root)}:{edge.line}"
        for edge in imports(files)
        if None not in (layer[edge.importer], layer[edge.imported]) and layer[edge.imported] > layer[edge.importer]
    ]


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """Who imports whom; a facade's `TYPE_CHECKING` re-exports are left out, since a name imported from a facade
    already counts as an import of its own module (they would only make circles that never run)."""
    graph: dict[str, set[str]] = {module: set() for module in files}
    for edge in imports(files):
        if not (edge.type_checking and files[edge.importer].name == "__init__.py"):
            graph[edge.importer].add(edge.imported)
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


def benchmark_graph() -> dict[str, set[str]]:
    """The benchmarks' imports of each other when they load (by file name: `python benchmarks/x.py` puts their folder
    on sys.path). A benchmark that runs another's backend imports it in a function, after both loaded."""
    folder = ROOT / "benchmarks"
    names = {path.stem for path in python_files(folder)}
    graph: dict[str, set[str]] = {name: set() for name in names}
    for path in python_files(folder):
        for statement, type_checking in _statements(path, in_functions=False):
            if type_checking:
                continue
            for base, name in _targets(statement, f"benchmarks.{path.stem}", is_package=False):
                base = base.removeprefix("benchmarks.")
                graph[path.stem] |= {target for target in (base, name) if target in names and target != path.stem}
    return graph


def test_no_module_is_over_600_lines_and_the_entry_points_stay_short():
    too_long = {}
    for root in (PACKAGE, ROOT / "callbacks", ROOT / "benchmarks"):
        for path in python_files(root):
            lines = len(path.read_text().splitlines())
            limit = ENTRY_POINTS.get(path.name, MAX_LINES) if path.parent == PACKAGE else MAX_LINES
            if lines > limit:
                too_long[str(path.relative_to(ROOT))] = (lines, limit)
    assert not too_long, f"modules over their line limit (lines, limit): {too_long}"


def test_the_layout_table_lists_every_folder_and_top_level_module_once_in_numbered_layers():
    layers = read_layers()
    numbers = sorted(set(layers.values()))
    assert numbers == list(range(1, len(numbers) + 1)), f"{LAYOUT.name}'s layers are not numbered 1, 2, ...: {numbers}"
    present = {f"{p.name}/" for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    present |= {p.name for p in PACKAGE.glob("*.py")} | {"callbacks/"}
    assert not present - set(layers), f"{LAYOUT.name}'s table lacks {sorted(present - set(layers))}: give each a layer"
    assert not set(layers) - present, f"{LAYOUT.name}'s table lists {sorted(set(layers) - present)}, not in the tree"
    assert layers[FACADE] == max(layers.values()), "the public facade imports every layer: it is the top one"


def test_every_import_goes_to_the_importers_own_layer_or_a_lower_one():
    """Function-level imports and those under `TYPE_CHECKING` count: they import the module all the same."""
    assert len(package_files(ROOT)) > 100  # the tree, not a handful of files
    upward = upward_imports(ROOT, read_layers())
    assert not upward, "imports of a higher layer (see docs/concepts/layout.md):\n" + "\n".join(upward)


def test_there_is_no_import_circle_in_the_package_or_its_callbacks():
    graph = import_graph(package_files(ROOT))
    assert "lightning_grpo.training.loss" in graph["lightning_grpo.module"]
    cycle = find_cycle(graph)
    assert cycle is None, f"import circle: {' -> '.join(cycle or [])}"


def test_there_is_no_import_cycle_in_the_benchmarks():
    graph = benchmark_graph()
    assert "common" in graph["generation"]
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle or [])}"


# The checker itself, on planted trees: it must find what it is meant to find, wherever the import is written.

PLANTED_LAYERS = {"models/": 3, "rollout/": 5, FACADE: 19}
PLACEMENTS = {
    "module top": "from ..rollout.b import B\n",
    "function": "def f():\n    from ..rollout.b import B\n",
    "TYPE_CHECKING": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..rollout.b import B\n",
    "try": "try:\n    from lightning_grpo.rollout import b\nexcept ImportError:\n    pass\n",
    "if": "import sys\nif sys.platform:\n    import lightning_grpo.rollout.b\n",
    "facade name": "def f():\n    from lightning_grpo.rollout import B\n",
}


def plant(root: Path, files: dict[str, str]) -> Path:
    for name, text in {"lightning_grpo/__init__.py": "", **files}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_the_checker_finds_a_planted_import_of_a_higher_layer_wherever_it_is_written(tmp_path, placement):
    facade = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n"
    root = plant(
        tmp_path,
        {
            "lightning_grpo/models/__init__.py": "",
            "lightning_grpo/models/a.py": PLACEMENTS[placement],
            "lightning_grpo/rollout/__init__.py": facade,
            "lightning_grpo/rollout/b.py": "from ..models import a\nB = 1\n",  # downward: allowed
        },
    )
    upward = upward_imports(root, PLANTED_LAYERS)
    assert len(upward) == 1, upward
    assert upward[0].startswith("lightning_grpo.models.a imports lightning_grpo.rollout.b (layer 5 above 3) at ")


def test_the_checker_finds_a_planted_circle_made_of_lazy_imports(tmp_path):
    root = plant(
        tmp_path,
        {
            "lightning_grpo/rollout/__init__.py": "",
            "lightning_grpo/rollout/b.py": "def f():\n    from . import c\n",
            "lightning_grpo/rollout/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .d import D\n",
            "lightning_grpo/rollout/d.py": "from .b import f\n",
        },
    )
    assert upward_imports(root, PLANTED_LAYERS) == []
    cycle = find_cycle(import_graph(package_files(root)))
    assert cycle == ["lightning_grpo.rollout.b", "lightning_grpo.rollout.c", "lightning_grpo.rollout.d"] + [
        "lightning_grpo.rollout.b"
    ]


def test_a_name_imported_from_a_facade_counts_as_its_own_module_and_makes_no_circle_through_the_facade(tmp_path):
    facade = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n    from .c import C\n"
    root = plant(
        tmp_path,
        {
            "lightning_grpo/rollout/__init__.py": facade,
            "lightning_grpo/rollout/b.py": "B = 1\n",
            "lightning_grpo/rollout/c.py": "from lightning_grpo.rollout import B\nC = B\n",
        },
    )
    graph = import_graph(package_files(root))
    assert graph["lightning_grpo.rollout.c"] == {"lightning_grpo.rollout.b"} and find_cycle(graph) is None
    (root / "lightning_grpo/rollout/b.py").write_text("from lightning_grpo.rollout import C\nB = 1\n")
    assert find_cycle(import_graph(package_files(root))) is not None  # b -> c -> b, through the facade's names


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
