"""MkDocs hooks: fill the reference pages' markers from the code, so the pages cannot drift from it.

- `<!-- options: CLASS -->` (e.g. `lightning_grpo.GRPOModule`): the list of the class's options (`options.py`).
- `<!-- api-page: PAGE -->`: the mkdocstrings blocks of one reference page, as `api_pages.PAGES` lays it out.
- `<!-- api-index -->`: every documented name with its page and its docstring's first line.
- `<!-- metrics -->`: every logged metric (`metrics_table.py`, from `lightning_grpo.training.metric_catalog`).
- `<!-- cli -->`: `lightning-grpo --help` and each subcommand's, from `cli_help.py` run in a subprocess.

A parameter the class docstring's `Args:` leaves out is a warning, which `mkdocs build --strict` turns into a failure.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from mkdocs.plugins import get_plugin_logger

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import api_pages as _api_pages  # noqa: E402
import metrics_table as _metrics  # noqa: E402
import options as _options  # noqa: E402

log = get_plugin_logger("lightning_grpo_docs")
_MARKER = re.compile(r"<!-- (options|api-page): ([\w.]+) -->|<!-- (cli|api-index|metrics) -->")
_cli: subprocess.Popen | None = None


def on_pre_build(config, **kwargs) -> None:
    """Start the CLI's `--help` runs while the pages are read."""
    global _cli
    env = {**os.environ, "COLUMNS": "100", "HF_HUB_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}
    _cli = subprocess.Popen(
        [sys.executable, str(HERE / "cli_help.py")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def _import(path: str):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _options_table(path: str) -> str:
    cls = _import(path)
    missing = _options.undocumented(cls)
    if missing:
        log.warning(f"{path}: the docstring's Args: section does not document {', '.join(missing)}; add them.")
    return _options.markdown_list(cls)


def _griffe_path(path: str) -> str:
    """The path griffe reads `path` under: the callbacks' sources live in callbacks/ (installed under lightning_grpo/)."""
    return path.removeprefix("lightning_grpo.") if path.startswith("lightning_grpo.callbacks.") else path


def _own_members(obj: object) -> list[str] | bool:
    """A class's own public API: what it defines that overrides nothing of its bases (Lightning's hooks are left
    out), its dataclass fields and annotated attributes. False for a function or a constant."""
    if not inspect.isclass(obj):
        return False
    inherited = {name for base in obj.__mro__[1:] for name in vars(base)}
    names = [name for name in vars(obj) if not name.startswith("_") and name not in inherited]
    names += [f.name for f in dataclasses.fields(obj)] if dataclasses.is_dataclass(obj) else []
    names += [name for name in vars(obj).get("__annotations__", {}) if not name.startswith("_")]
    return list(dict.fromkeys(names)) or False


def _block(path: str, heading_level: int) -> str:
    members = _own_members(_import(path))
    options = [f"heading_level: {heading_level}", f"members: {json.dumps(members)}"]
    if _griffe_path(path) != path:
        options.append(f"heading: {path}")
    return f"::: {_griffe_path(path)}\n    options:\n" + "\n".join(f"      {option}" for option in options)


def _api_page(page: str) -> str:
    _, sections = _api_pages.PAGES[page]
    if len(sections) == 1:
        return "\n\n".join(_block(path, 2) for path in sections[0][1])
    return "\n\n".join(
        f"## {heading}\n\n" + "\n\n".join(_block(path, 3) for path in paths) for heading, paths in sections
    )


def _constant_comment(path: str) -> str:
    """The `#:` comment above `NAME = ...` in the module that defines it (a package's own or a submodule's)."""
    package, _, name = path.rpartition(".")
    module = importlib.import_module(package)
    for source in [module, *(value for value in vars(module).values() if inspect.ismodule(value))]:
        lines = inspect.getsource(source).splitlines()
        for index, line in enumerate(lines):
            if line.startswith(f"{name} =") and index and lines[index - 1].startswith("#:"):
                return lines[index - 1].removeprefix("#:").strip()
    return ""


def _summary(path: str) -> str:
    """The first paragraph of the docstring; a constant's `#:` comment."""
    obj = _import(path)
    doc = (inspect.getdoc(obj) or "") if callable(obj) else _constant_comment(path)
    if not doc:
        raise ValueError(f"{path} has no docstring for the API index: give it one.")
    return doc.split("\n\n")[0].replace("\n", " ")


def _api_index() -> str:
    parts = []
    for page, (title, sections) in _api_pages.PAGES.items():
        parts += [f"## {title}", "", f"On [the {title} page]({page}.md):", ""]
        for heading, paths in sections:
            if len(sections) > 1:
                parts += [f"### {heading}", ""]
            parts += ["| name | what it is |", "|---|---|"]
            for path in paths:
                name, summary = path.rpartition(".")[2], _summary(path).replace("|", "\\|")
                parts.append(f'| [<code class="lg-name">{name}</code>][{_griffe_path(path)}] | {summary} |')
            parts.append("")
    return "\n".join(parts)


def _cli_reference() -> str:
    if _cli is None:
        raise RuntimeError("the CLI help subprocess was not started (on_pre_build did not run)")
    out, err = _cli.communicate(timeout=600)
    if _cli.returncode != 0:
        raise RuntimeError(f"docs/_gen/cli_help.py failed ({_cli.returncode}):\n{err[-3000:]}")
    helps = json.loads(out)
    parts = ["## `lightning-grpo --help`", "", "```text", helps.pop("").rstrip(), "```"]
    for name, text in helps.items():
        lines = text.rstrip().splitlines()
        parts += ["", f"## `lightning-grpo {name}`", ""]
        if len(lines) > 60:  # fit/validate list every Trainer option too: folded
            parts += [f'??? example "`lightning-grpo {name} --help` ({len(lines)} lines)"', "", "    ```text"]
            parts += [f"    {line}" if line else "" for line in lines] + ["    ```"]
        else:
            parts += ["```text", *lines, "```"]
    return "\n".join(parts)


def on_page_markdown(markdown: str, page, config, files, **kwargs) -> str:
    def fill(match: re.Match) -> str:
        generated = {"cli": _cli_reference, "api-index": _api_index, "metrics": _metrics.markdown}
        if match.group(3):
            return generated[match.group(3)]()
        kind, argument = match.group(1), match.group(2)
        return _options_table(argument) if kind == "options" else _api_page(argument)

    return _MARKER.sub(fill, markdown)
