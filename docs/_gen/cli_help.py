"""Prints, as JSON, the `--help` of `lightning-grpo` and of each of its subcommands, for the CLI reference.

Run by the docs build (`docs/_gen/hooks.py`) in a subprocess, so the command's imports do not slow the build's own
process. Subcommands are those `lightning-grpo --help` lists, plus those `lightning_grpo.cli.main` dispatches itself.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys

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
    return out.getvalue().rstrip() + "\n"


def subcommands(top: str) -> list[str]:
    listed = re.search(r"\{([\w,-]+)\}", top)
    names = listed.group(1).split(",") if listed else []
    return [*names, *(name for name in ALSO if name not in names)]


def main() -> None:
    top = help_text([])
    helps = {"": top, **{name: help_text([name]) for name in subcommands(top)}}
    json.dump(helps, sys.stdout)


if __name__ == "__main__":
    main()
