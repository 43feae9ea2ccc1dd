"""Every code block of the docs fits the page's column: at most 88 characters a line.

The site's text column shows about 88 monospace characters; a longer line is cut at the right edge (the reader must
scroll each block sideways). Checked: every fenced block of every page under docs/ and of README.md, every file a
page includes with `--8<--` (whole, or the lines it names), and the generated `--help` text of the CLI reference.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
SNIPPETS = DOCS / "snippets"  # mkdocs.yml's pymdownx.snippets base_path
WIDTH = 88

_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})")
_INCLUDE = re.compile(r"""^ *-{2}8<-{2} +["']?(?P<name>[^"':]+)(?::(?P<start>\d+)(?::(?P<end>\d+))?)?["']?\s*$""")


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def code_lines(text: str) -> list[tuple[int, str]]:
    """The lines inside fenced code blocks, as (1-based line number, text without the fence's indentation)."""
    found: list[tuple[int, str]] = []
    fence: re.Match | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        opening = _FENCE.match(line)
        if fence is None:
            fence = opening
            continue
        closes = opening is not None and opening["fence"][0] == fence["fence"][0]
        if closes and len(opening["fence"]) >= len(fence["fence"]) and not line[opening.end() :].strip():
            fence = None
            continue
        indent = len(fence["indent"])
        found.append((number, line[indent:] if line[:indent].isspace() else line))
    return found


def includes(text: str) -> list[tuple[Path, int, int | None]]:
    """The files the page includes with `--8<--`: (path, first line, last line or None for the rest)."""
    found = []
    for line in text.splitlines():
        match = _INCLUDE.match(line)
        if match:
            start = int(match["start"]) if match["start"] else 1
            end = int(match["end"]) if match["end"] else None
            found.append((SNIPPETS / match["name"].strip(), start, end))
    return found


def too_wide(lines: list[tuple[int, str]], where: str) -> list[str]:
    return [f"{where}:{number}: {len(line)} chars: {line.strip()[:60]}" for number, line in lines if len(line) > WIDTH]


def test_code_lines_reads_fenced_blocks_only_and_strips_their_indentation():
    text = (
        "prose " + "x" * 100 + "\n```bash\nshort\n" + "y" * 89 + "\n```\n    ```text\n    " + "z" * 88 + "\n    ```\n"
    )
    assert code_lines(text) == [(3, "short"), (4, "y" * 89), (7, "z" * 88)]
    assert too_wide(code_lines(text), "page.md") == [f"page.md:4: 89 chars: {'y' * 60}"]
    # a longer fence holds a shorter one as text; the block runs to the end of the page without a closing fence
    assert code_lines("````md\n```python\nx\n```\n````\nafter\n```\nopen") == [
        (2, "```python"),
        (3, "x"),
        (4, "```"),
        (8, "open"),
    ]


def test_includes_reads_whole_files_and_line_ranges():
    text = '--8<-- "first_reward.py"\n    --8<-- "a.py:3:9"\nnot --8<-- "b.py"\n'
    assert includes(text) == [(SNIPPETS / "first_reward.py", 1, None), (SNIPPETS / "a.py", 3, 9)]


@pytest.mark.parametrize("page", pages(), ids=lambda page: str(page.relative_to(ROOT)))
def test_code_blocks_of_each_page_fit_88_columns(page):
    text = page.read_text()
    where = str(page.relative_to(ROOT))
    wide = too_wide(code_lines(text), where)
    for path, start, end in includes(text):
        assert path.is_file(), f"{where} includes {path.relative_to(ROOT)}, which does not exist"
        lines = path.read_text().splitlines()
        chosen = list(enumerate(lines, start=1))[start - 1 : end]
        wide += too_wide(chosen, f"{path.relative_to(ROOT)} (included by {where})")
    assert not wide, f"code lines wider than {WIDTH} columns (re-wrap them):\n" + "\n".join(wide)


@pytest.mark.timeout(120)
def test_generated_cli_help_fits_88_columns():
    """The CLI reference's `--help` blocks, produced as the docs build produces them (docs/_gen/cli_help.py)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1", "COLUMNS": "200"}
    result = subprocess.run(
        [sys.executable, str(DOCS / "_gen" / "cli_help.py")], env=env, capture_output=True, text=True, timeout=110
    )
    assert result.returncode == 0, result.stderr[-3000:]
    helps = json.loads(result.stdout)
    assert {"", "fit", "export"} <= set(helps)
    wide = []
    for name, text in helps.items():
        lines = list(enumerate(text.splitlines(), start=1))
        wide += too_wide(lines, f"lightning-grpo {name} --help".replace("  ", " "))
    assert not wide, "the CLI reference's --help lines wider than 88 columns:\n" + "\n".join(wide)
