"""MkDocs hooks: fill the reference pages' markers from the code, so the pages cannot drift from it.

- `<!-- options: CLASS -->` (e.g. `lightning_grpo.GRPOModule`): the class's option table (`options.py`).
- `<!-- api: lightning_grpo -->` / `<!-- api: lightning_grpo.callbacks -->`: one mkdocstrings block per public name.
- `<!-- cli -->`: `lightning-grpo --help` and each subcommand's, from `cli_help.py` run in a subprocess.

A parameter the class docstring's `Args:` leaves out is a warning, which `mkdocs build --strict` turns into a failure.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from mkdocs.plugins import get_plugin_logger

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import options as _options  # noqa: E402

log = get_plugin_logger("lightning_grpo_docs")
_MARKER = re.compile(r"<!-- (options|api): ([\w.]+) -->|<!-- (cli) -->")
_cli: subprocess.Popen | None = None

# where each group of top-level names is defined (the first part of its module path), in the page's order
_API_GROUPS = {
    "module": "The module and the data module",
    "datamodule": "The module and the data module",
    "contract": "The module and the data module",
    "rollout": "The rollout process",
    "pipeline": "Rank 0's pipeline",
    "scoring": "Trainer scoring",
    "training": "Training",
    "weights": "Weight sync and serving",
    "serving": "Weight sync and serving",
    "cli": "Export",
}


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
    return _options.markdown_table(cls)


def _api(package: str) -> str:
    module = importlib.import_module(package)
    if package == "lightning_grpo.callbacks":
        # the callbacks' sources live in callbacks/ (installed under lightning_grpo/); griffe reads them there
        return "\n\n".join(
            f"::: callbacks.{name}\n    options:\n      heading: {package}.{name}" for name in module.__all__
        )
    groups: dict[str, list[str]] = {}
    for name in module.__all__:
        top = module._EXPORTS[name].split(".")[0]
        groups.setdefault(_API_GROUPS.get(top, "Other"), []).append(name)
    order = list(dict.fromkeys([*_API_GROUPS.values(), "Other"]))
    parts = []
    for title in order:
        for index, name in enumerate(groups.get(title, [])):
            parts.append((f"## {title}\n\n" if index == 0 else "") + f"::: {package}.{name}")
    return "\n\n".join(parts)


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
        if match.group(3) == "cli":
            return _cli_reference()
        kind, path = match.group(1), match.group(2)
        return _options_table(path) if kind == "options" else _api(path)

    return _MARKER.sub(fill, markdown)
