"""Objects named by import paths (reward functions, trainer scorers, loop classes), and lazily loaded exports."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def import_object(path: str, what: str) -> Any:
    """The object an import path names: `"pkg.module.name"` or `"pkg.module:name"`.

    Raises:
        ValueError: the path is malformed or cannot be imported; the message names `what`, the path and why.
    """
    if not isinstance(path, str) or not path:
        raise ValueError(f"`{what}` entry {path!r} is not an import path like 'pkg.module.name'.")
    module_name, sep, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not (sep and module_name and attr):
        raise ValueError(f"`{what}` entry {path!r} is not an import path like 'pkg.module.name'.")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"`{what}` entry {path!r} cannot be imported: {error}") from error


def resolve_callable(spec: str | Callable, what: str) -> Callable:
    """A callable, or the callable an import path names.

    Raises:
        ValueError: the path does not name an importable callable (the message names the path and why).
    """
    if callable(spec):
        return spec
    value = import_object(spec, what)
    if not callable(value):
        raise ValueError(
            f"`{what}` entry {spec!r} names a {type(value).__name__}, not a callable: name a function or a class."
        )
    return value


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` for a package whose public names (name -> submodule) load on first use.

    A spawned process that imports one submodule then does not pay for importing its siblings (torch, Lightning).
    """
    module = importlib.import_module(package)

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{exports[name]}", package), name)
        setattr(module, name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(module)) | set(exports))

    return __getattr__, __dir__
