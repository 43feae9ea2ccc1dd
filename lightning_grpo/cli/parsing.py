"""The command line's parsing helpers, shared by every subcommand: the description, and an argparse parser whose
errors name the closest valid subcommand, option or choice (`SuggestingParser`, `suggestion`).

A leaf of `cli/`: `app` (the dispatcher), `lightning_cli` and `export` import it; it imports nothing of the package.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from typing import NoReturn

DESCRIPTION = "Asynchronous GRPO with PyTorch Lightning: fit or validate a GRPOModule on a GRPODataModule."

# argparse's message for a subcommand, jsonargparse's for a `Literal` option
_CHOICE_ERRORS = (
    r"invalid choice: '(?P<value>[^']*)' \(choose from (?P<choices>.*)\)",
    r"Literal\[(?P<choices>.*)\]\. Got value: (?P<value>\S+)",
)


def closest(word: str, choices: list[str]) -> str | None:
    """The choice most like `word` (a typo's likely meaning), or None when none is close: of the choices difflib
    finds close, the fewest typing mistakes away (`fti` is `fit`, not `sft`)."""
    matches = difflib.get_close_matches(word, choices, n=5, cutoff=0.6)
    return min(matches, key=lambda match: _typing_distance(word, match)) if matches else None


def _typing_distance(a: str, b: str) -> int:
    """Letters added, dropped, changed or swapped with a neighbour to turn `a` into `b` (optimal string alignment)."""
    previous: list[int] = []  # the row before `current`, from the second row on
    current = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        before, previous, current = previous, current, [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            cost = a[i - 1] != b[j - 1]
            current[j] = min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                current[j] = min(current[j], before[j - 2] + 1)
    return current[len(b)]


def suggestion(message: str, options: list[str]) -> str:
    """` Did you mean ...?` for the first unrecognized option or invalid choice an argparse `message` names, else ''."""
    unrecognized = re.search(r"nrecognized arguments: (.*)", message)
    if unrecognized:
        for token in unrecognized.group(1).split():
            match = closest(token.split("=", 1)[0], options) if token.startswith("--") else None
            if match:
                return f". Did you mean {match}?"
        return ""
    key = re.search(r"does not accept option '([^']*)'", message)  # a YAML key
    if key:
        match = closest(key.group(1), [option.removeprefix("--") for option in options])
        return f". Did you mean '{match}'?" if match else ""
    for pattern in _CHOICE_ERRORS:
        choice = re.search(pattern, message)
        if choice:
            match = closest(choice["value"], re.findall(r"'([^']*)'", choice["choices"]))
            return f". Did you mean '{match}'?" if match else ""
    return ""


class SuggestingParser(argparse.ArgumentParser):
    """An argparse parser whose errors name the closest valid subcommand, option or choice (exit code 2)."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}{suggestion(message, list(self._option_string_actions))}\n")
