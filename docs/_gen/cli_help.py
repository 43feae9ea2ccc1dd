"""Prints, as JSON, the `--help` of `lightning-grpo` and of each of its subcommands, for the CLI reference.

Run by the docs build (`docs/_gen/hooks.py`) in a subprocess, so the command's imports do not slow the build's own
process. Subcommands are those `lightning-grpo --help` lists, plus those `lightning_grpo.cli.main` dispatches itself.
Every line fits the site's code column (`WIDTH`): argparse wraps at `COLUMNS`, and what it cannot break (a usage
group longer than the space after `usage: lightning-grpo fit`, a long first docstring line) is wrapped here.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sys
import textwrap

WIDTH = 88  # the docs' code column (tests/docs/test_code_width.py)
ALSO = ("export", "vllm-serve")  # dispatched by `main` before LightningCLI; listed here in case `--help` omits them


def help_text(args: list[str]) -> str:
    from lightning_grpo.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            main([*args, "--help"])
        except SystemExit as exit_:
            if exit_.code not in (0, None):
                raise RuntimeError(
                    f"`lightning-grpo {' '.join([*args, '--help'])}` exited {exit_.code}:\n{out.getvalue()}"
                ) from None
    return fit_width(out.getvalue().rstrip()) + "\n"


def _usage_groups(text: str) -> list[str]:
    """`text` split at the spaces outside brackets: `[--a A] {x,y}` -> `[--a A]`, `{x,y}`."""
    groups, current, depth = [], "", 0
    for char in text:
        depth += (char in "[{(") - (char in "]})")
        if char == " " and depth == 0:
            groups, current = (groups + [current] if current else groups), ""
        else:
            current += char
    return groups + [current] if current else groups


def _reflow_usage(lines: list[str], width: int) -> list[str]:
    """The usage lines refilled with a 4-space indent; a group too long for a line of its own breaks at its spaces."""
    out, line = [], ""
    for group in _usage_groups(" ".join(line.strip() for line in lines)):
        if line and len(f"{line} {group}") > width:
            out.append(line)
            line = ""
        line = f"{line} {group}" if line else (group if not out else f"    {group}")
    out.append(line)
    return [part for line in out for part in _wrap(line, width)]


def _wrap(line: str, width: int) -> list[str]:
    """`line` as is when it fits, else broken at spaces: text continues at its indentation, an option line
    (`--name {a,b}`) or a usage group 4 columns deeper."""
    if len(line) <= width:
        return [line]
    indent = line[: len(line) - len(line.lstrip())]
    deeper = line.lstrip().startswith(("-", "["))
    return textwrap.wrap(
        line.strip(),
        width,
        initial_indent=indent,
        subsequent_indent=indent + ("    " if deeper else ""),
        break_on_hyphens=False,
    )


def fit_width(text: str, width: int = WIDTH) -> str:
    """`text` (a `--help`) with every line at most `width` characters long."""
    lines = text.splitlines()
    usage_end = lines.index("") if "" in lines else len(lines)
    usage = lines[:usage_end] if lines and lines[0].startswith("usage:") else []
    if any(len(line) > width for line in usage):
        lines = _reflow_usage(usage, width) + lines[len(usage) :]
    return "\n".join(part for line in lines for part in _wrap(line, width))


def subcommands(top: str) -> list[str]:
    listed = re.search(r"\{([\w,-]+)\}", top)
    names = listed.group(1).split(",") if listed else []
    return [*names, *(name for name in ALSO if name not in names)]


def main() -> None:
    os.environ["COLUMNS"] = str(WIDTH)  # argparse wraps its help at this width, whatever the terminal
    top = help_text([])
    helps = {"": top, **{name: help_text([name]) for name in subcommands(top)}}
    json.dump(helps, sys.stdout)


if __name__ == "__main__":
    main()
