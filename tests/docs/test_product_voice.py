"""The README and the docs speak of the product as it is: no word of our issues, targets or reverted attempts (the
commit messages and CHANGELOG.md hold the history). Links to other projects' issues are references, not history."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# phrases of a lab notebook: our issue numbers, targets, what was tried, reverted or removed
HISTORY = re.compile(
    r"(?<!TRL )(?<!upstream )\bissue #?\d+|\bour target\b|\bthe target (was|is)\b|\brevert(ed|ing)?\b|\bwe tried\b"
    r"|\bwas tried\b|\bsince removed\b|\bused to be\b|\bbefore this change\b|\bagainst the issue",
    re.IGNORECASE,
)


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_no_page_speaks_of_how_it_was_built():
    found = [
        f"{page.relative_to(ROOT)}:{number}: {match.group(0)!r}"
        for page in _pages()
        for number, line in enumerate(page.read_text().splitlines(), 1)
        for match in [HISTORY.search(re.sub(r"\]\([^)]*\)", "]", line))]  # link targets are addresses, not words
        if match
    ]
    assert not found, "history belongs in CHANGELOG.md or a commit message:\n" + "\n".join(found)


def test_the_check_finds_a_lab_notebook_line():
    for line in ("Against the issue's checks", "a setting since removed", "issue 42 asked for", "we tried jemalloc"):
        assert HISTORY.search(line), line
    assert not HISTORY.search("GRPOTrainer ([TRL issue 6789](https://github.com/huggingface/trl/issues/6789))")
